#!/usr/bin/env bash
# The GPU checks in one command, for a machine with CUDA lent for about 10 minutes:
#
#   benchmarks/gpu_check.sh OUT [CASES]
#
# 1. the `gpu` test tier (CUDA tests of the ledger, the loop and the benchmark) -> OUT/pytest.log;
# 2. the timing on NCCL in bf16, every GPU of the machine (`python -m benchmarks.run --device cuda --precision bf16
#    --sweep none`), CASES (default: both CPU cases and the one sized for a GPU), every launch given BUDGET_PER_S
#    seconds of rounds -> OUT/bench/results.json, written after every launch;
# 3. the memory sweep of the 27.3M case (the CUDA allocator's peak at K = 1 and 16 on DDP, FSDP2 and Accelerate)
#    -> OUT/memory/results.json.
# Each stage has its own limit (TESTS_S, BENCH_S, MEMORY_S seconds; 150 + 330 + 90 by default: under 10 minutes), so
# a short lease still returns what finished. VARIANTS replaces stage 2's variants. Then, where the repository lives:
#   python -m benchmarks.report --store OUT/bench/results.json --store OUT/memory/results.json [--allow-partial]
# stores both and renders BENCHMARKS.md's GPU section. It prints each stage's exit status and exits 0 once every
# stage has run. PYTHON picks the interpreter (default python3); distaccum runs from this checkout (PYTHONPATH).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT [CASES]}
cases=${2:-0.9M_micro256,27.3M_micro4,210M_micro1024}
variants=${VARIANTS:-ddp_no_sync,distaccum,compute_floor,ddp_no_sync_twin,distaccum_compiled,ddp_no_sync_compiled,ddp_no_sync_compiled_static,ddp_no_sync_compiled_twin}
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
timeout -k 10 "${TESTS_S:-150}" "$python" -m pytest -p no:cacheprovider -m gpu -q -rs --timeout 140 \
  tests/test_ledger_gpu.py tests/test_gpu.py tests/test_benchmark_smoke.py >"$out/pytest.log" 2>&1
echo "gpu tests: exit $?"
tail -n 15 "$out/pytest.log"
timeout -k 10 "${BENCH_S:-330}" "$python" -m benchmarks.run --device cuda --precision bf16 --sweep none \
  --cases "$cases" --variants "$variants" --budget-s "${BUDGET_PER_S:-10}" \
  --timeout 150 --out "$out/bench" >"$out/bench.log" 2>&1
echo "benchmark: exit $? (124: stopped at its limit; results.json keeps the launches that finished)"
grep '^\[timing\]' "$out/bench.log" || true
timeout -k 10 "${MEMORY_S:-90}" "$python" -m benchmarks.run --device cuda --precision bf16 --no-timing \
  --cases 27.3M_micro4 --sweep ddp_no_sync,distaccum,distaccum_fsdp,distaccum_accelerate \
  --timeout 60 --out "$out/memory" >"$out/memory.log" 2>&1
echo "memory sweep: exit $?"
grep '^\[memory\]' "$out/memory.log" || true
