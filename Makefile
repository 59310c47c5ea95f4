# One command equals CI: `.ci/run` runs `make test`.
# TORCH_SPEC picks the torch build: the default CPU wheel; on GPU machines e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
PY := $(VENV)/bin/python
PYTEST_ARGS ?= --durations=25 --junitxml=runs/junit.xml  # every test's time, for balancing the suite
# Tests run on this many pytest-xdist workers, a whole test file per worker (module fixtures are
# built once), the longest files first (tests/serial_lock.py, from tests/durations.json). Most tests wait on process start-up more than they compute, so 2 fill CI's 2 cores;
# `serial` tests (timings) still run alone (tests/serial_lock.py). PYTEST_WORKERS=0: one process.
# A worker that crashes fails the run at once (--max-worker-restart 0): a replaced worker once left
# the loadfile scheduler waiting for the crashed file's other tests until CI's limit.
PYTEST_WORKERS ?= 2

.PHONY: install demo test check stress lint bench bench-smoke bench-docs clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, alone: anything installed later is pinned to it by constraints.txt
	$(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed  ## set up .venv (torch first, then distaccum and its extras)

demo: install  ## train the embedded default on 2 local workers, then verify it
	$(VENV)/bin/distaccum train run_dir=runs/demo trainer.resume=false
	$(VENV)/bin/distaccum verify run_dir=runs/demo-verify trainer.max_steps=5 log.console=quiet

LINTED := distaccum launch tests benchmarks examples

DS_OP_BUILD := DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(HOME)/.cache/distaccum/torch_extensions $(PY) -c \
  "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"

test: install  ## the whole suite, exactly as CI runs it (lint and types first)
	# DeepSpeed compiles its CPU communication op on first use (~45 s): once per machine, here, into the cache every
	# run and test uses (engine.extensions_dir's default), not inside several test files at once (a no-op when cached).
	# It compiles while lint and types run (each takes about one core): neither waits for the other.
	@mkdir -p runs
	$(DS_OP_BUILD) > runs/deepspeed-op-build.log 2>&1 & build=$$!; \
	  $(MAKE) --no-print-directory lint; lint=$$?; \
	  wait $$build; built=$$?; \
	  if [ $$built -ne 0 ]; then echo "DeepSpeed's CPU op did not build:"; cat runs/deepspeed-op-build.log; fi; \
	  [ $$lint -eq 0 ] && [ $$built -eq 0 ]
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 $(PYTEST_ARGS); \
	  code=$$?; $(PY) tests/tiers.py runs/junit.xml; exit $$code

# The inner loop, at most 5 minutes: lint and types, the unit tier, and one end-to-end run of every engine (the
# engine matrix's shared launch against DDP). `make test` is what CI runs.
check: install lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m unit --junitxml=runs/junit-unit.xml -q
	$(PY) -m pytest tests/test_engines.py -k test_engine_matches_ddp_every_step --junitxml=runs/junit-engines.xml -q
	$(PY) tests/tiers.py runs/junit-unit.xml --slowest 5
	$(PY) tests/tiers.py runs/junit-engines.xml --slowest 0

# On a quiet machine, by hand: a rare failure shown gone (100 processes running distaccum.Trainer in-process exit 0;
# DISTACCUM_EXIT_RUNS=N), and the timing assertions CI cannot hold (the planner's predictions within 20%).
stress: install
	$(PY) -m pytest -m "stress or timing" -s --junitxml=runs/junit-stress.xml tests/test_clean_exit.py tests/test_planner_accuracy.py
	$(PY) tests/tiers.py runs/junit-stress.xml --slowest 5

lint: install  ## ruff (lint and format) and mypy on distaccum/, as `make test` runs them
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

# make bench: on a quiet machine, alone (about half an hour on 2 cores); its CPU figures go into BENCHMARKS.md with
# make bench-docs. BENCH_VARIANTS: what the timing interleaves (benchmarks/variants.py); BENCH_ARGS: more options
# of python -m benchmarks.run (e.g. --budget-s 60 for a shorter run, --cases 0.9M_micro256).
BENCH_VARIANTS ?= ddp_no_sync,distaccum,compute_floor,ddp_no_sync_twin,distaccum_compiled,ddp_no_sync_compiled,ddp_no_sync_compiled_static,ddp_no_sync_compiled_twin
BENCH_ARGS ?=

bench: install  ## timing, memory in K and operator counts on a quiet machine (by hand; CI runs the smoke size)
	$(PY) -m benchmarks.run --out runs/bench --variants $(BENCH_VARIANTS) $(BENCH_ARGS)

bench-smoke: install  ## the CI size of the benchmark (structure, not figures)
	$(PY) -m benchmarks.run --smoke --out runs/bench-smoke

bench-docs: install  ## keep runs/bench/results.json in docs/results/ and render BENCHMARKS.md from it
	$(PY) -m benchmarks.report --store runs/bench/results.json

clean:
	rm -rf runs .pytest_cache
