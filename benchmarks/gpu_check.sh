#!/usr/bin/env bash
# The GPU checks in one command, for a machine with CUDA (a lent GPU, a cloud node):
#
#   benchmarks/gpu_check.sh OUT [CASES]
#
# 1. the timing harness in bf16 on NCCL (every GPU of the machine; `python -m benchmarks.run --device cuda
#    --precision bf16 --sweep none`), eager and compiled, CASES (default: both standard cases and the one
#    sized for a GPU) -> OUT/gpu/results.json, written after every launch;
# 2. the `gpu` test tier -> OUT/pytest.log;
# 3. the engine sweep of the 27.3M case on the GPU (peak memory from the CUDA allocator, flat in K?, for
#    DDP and FSDP2 in each sync mode) -> OUT/sweep/results.json.
# VARIANTS replaces stage 1's variants (e.g. ddp_no_sync,distaccum,distaccum_sync_records,compute_floor: the
# lagged records' saving, without the compiled pair). Each stage has its own limit (BENCH_S, TESTS_S, SWEEP_S seconds; 300 + 170 + 100 by default: under 10
# minutes, one call of a lent machine), so a short lease still returns what
# finished. Then, where the repository lives: python -m benchmarks.update_docs --timing-only --results
# OUT/gpu/results.json (the gpu-timing section) and --allow-partial --results OUT/sweep/results.json (gpu).
# Stage times seen on one H100 (this release's run, docs: BENCHMARKS.md "GPU figures"): timing 92 s for
# 27.3M_micro4, 61 s for 0.9M_micro256, 124 s for 210M_micro1024 at K = 1 and 4 (K = 16 did not fit); the
# test tier ran 12 of its 13 tests in 160 s; the sweep 9 of its 10 launches in 100 s. All three cases and
# stages need more than one 10-minute call: run the 210M case in a call of its own (`gpu_check.sh OUT 210M_micro1024`).
# It prints each stage's exit status and exits 0 once every stage has run. PYTHON picks the interpreter
# (default python3); distaccum runs from this checkout (PYTHONPATH).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT [CASES]}
cases=${2:-0.9M_micro256,27.3M_micro4,210M_micro1024}
variants=${VARIANTS:-ddp_no_sync,distaccum,compute_floor,ddp_no_sync_compiled,distaccum_compiled}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if ! "$python" -c "import torch, hydra, omegaconf" >/dev/null 2>&1; then  # else every stage fails, minutes later
  echo "gpu_check: $python cannot import torch, hydra and omegaconf: install distaccum's requirements" \
    "(pip install .) or put them on PYTHONPATH (a GPU image's own torch is fine)" >&2
  exit 2
fi
mkdir -p "$out"
nvidia-smi -L || true
timeout -k 10 "${BENCH_S:-300}" "$python" -m benchmarks.run --device cuda --precision bf16 --sweep none --rounds 6 \
  --cases "$cases" --variants "$variants" \
  --timeout 120 --out "$out/gpu" >"$out/bench.log" 2>&1
echo "benchmark: exit $? (124: stopped at its limit; results.json keeps the launches that finished)"
grep '^\[timing\]' "$out/bench.log" || true
timeout -k 10 "${TESTS_S:-170}" "$python" -m pytest -p no:cacheprovider -m gpu -q -rs --timeout 160 \
  tests/test_ledger_gpu.py tests/test_gpu.py tests/test_benchmark_smoke.py >"$out/pytest.log" 2>&1
echo "gpu tests: exit $?"
tail -n 15 "$out/pytest.log"
timeout -k 10 "${SWEEP_S:-100}" "$python" -m benchmarks.run --device cuda --precision bf16 --no-timing --cases 27.3M_micro4 \
  --sweep ddp_no_sync,distaccum,distaccum_fsdp,distaccum_fsdp_every_micro,distaccum_fsdp_unsharded \
  --timeout 60 --out "$out/sweep" >"$out/sweep.log" 2>&1
echo "engine sweep: exit $?"
grep -A12 '^Memory flat in K' "$out/sweep.log" || true
