#!/usr/bin/env bash
# One device session on a lent GPU machine, as one prepared script (docs/gpu_check_h200.md): build the planner,
# then, each part under its own time limit and most wanted first: the conv stage times, benchmarks/gpu_check.py,
# changing shapes on CUDA, offloading on CUDA and the CUDA unit tests. Under 9.5 minutes in all.
# Usage (from the repository root): benchmarks/gpu_session.sh OUT_DIR      (OUT_DIR: where the reports go)
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_session.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
step() { echo "== $(date -u +%H:%M:%S) $*"; }
step build
python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step "conv stage times"
(cd benchmarks && PYTHONPATH=..:. timeout 170 python3 cuda_stage_times.py --out "$OUT/cuda_stage_times.md" \
  >"$OUT/cuda_stage_times.log" 2>&1) || echo "cuda_stage_times: exit $?"
tail -4 "$OUT/cuda_stage_times.log"
step gpu_check
(cd benchmarks && PYTHONPATH=..:. timeout 170 python3 gpu_check.py --out "$OUT/gpu_check.md" >"$OUT/gpu_check.log" 2>&1)
grep -E "^\| [0-9]\.|FAIL" "$OUT/gpu_check.md" | head -20
step "changing shapes on CUDA"
PYTHONPATH=. timeout 110 python3 benchmarks/shapes.py --device cuda --n-layer 12 --n-embd 768 --vocab 8192 --batch 8 \
  --min-len 64 --max-len 1024 --runs 2 --threads 16 --variants rotor 2>&1 | tee "$OUT/shapes_cuda.txt"
step "offloading on CUDA"
PYTHONPATH=. timeout 40 python3 benchmarks/offload_gpu.py 2>&1 | tee "$OUT/offload_gpu.txt" | tail -12
step "CUDA unit tests"
timeout 60 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_offload*.py tests/test_memory.py \
  tests/test_checkpointable.py tests/test_lightning.py tests/test_bench.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -8
step done
