#!/usr/bin/env bash
# One device session on a lent GPU machine, as one prepared script (docs/gpu_check_h200.md): build the planner,
# then, each part under its own time limit and most wanted first: derived shapes on CUDA (tests/test_sizes_on_cuda.py),
# the conv stage times, benchmarks/gpu_check.py, changing shapes on CUDA, offloading on CUDA and the CUDA unit tests.
# The limits add up to 565 s. Carry `.whl` for the tests that import the CLI (docs/gpu_check_h200.md, "CUDA unit
# tests": jsonargparse, docstring-parser and typeshed-client, which the device image lacks).
# Usage (from the repository root): benchmarks/gpu_session.sh OUT_DIR      (OUT_DIR: where the reports go)
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_session.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
step() { echo "== $(date -u +%H:%M:%S) $*"; }
step build
if ls .whl/*.whl >/dev/null 2>&1; then  # jsonargparse and its two needs, which the device image lacks (carried)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step "derived shapes on CUDA (not yet passed on a GPU)"
PYTHONPATH=.:${PYTHONPATH:-} timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_sizes_on_cuda.py 2>&1 | tail -15
step "conv stage times"
(cd benchmarks && PYTHONPATH=..:.:${PYTHONPATH:-} timeout 160 python3 cuda_stage_times.py --out "$OUT/cuda_stage_times.md" \
  >"$OUT/cuda_stage_times.log" 2>&1) || echo "cuda_stage_times: exit $?"
tail -4 "$OUT/cuda_stage_times.log"
step gpu_check
(cd benchmarks && PYTHONPATH=..:.:${PYTHONPATH:-} timeout 130 python3 gpu_check.py --out "$OUT/gpu_check.md" >"$OUT/gpu_check.log" 2>&1)
grep -E "^\| [0-9]\.|FAIL" "$OUT/gpu_check.md" | head -20
step "changing shapes on CUDA"
PYTHONPATH=.:${PYTHONPATH:-} timeout 150 python3 benchmarks/shapes.py --device cuda --n-layer 12 --n-embd 768 \
  --vocab 8192 --batch 8 --min-len 64 --max-len 1024 --runs 2 --threads 16 --variants rotor rotor-measure 2>&1 \
  | tee "$OUT/shapes_cuda.txt"
step "offloading on CUDA"
PYTHONPATH=.:${PYTHONPATH:-} timeout 30 python3 benchmarks/offload_gpu.py 2>&1 | tee "$OUT/offload_gpu.txt" | tail -12
step "CUDA unit tests"
PYTHONPATH=.:${PYTHONPATH:-} timeout 50 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_offload*.py \
  tests/test_memory.py tests/test_checkpointable.py tests/test_lightning.py tests/test_bench.py tests/test_twin_stages.py \
  tests/test_profile_cuda_warmup.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -8
step done
