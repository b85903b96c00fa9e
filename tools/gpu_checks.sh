#!/usr/bin/env bash
# Every GPU check in one device call (prepare with tools/gpu_wheels.sh; carry .whl):
#   CAPTURE=path/to/capture_cuda_optim_more.py bash tools/gpu_checks.sh
# 1. the CUDA capture of the optimizer cases tests/data/cuda_optim.npz lacks (when CAPTURE
#    names its script), 2. the gpu-marked tests, 3. benchmarks/bench_gpu.py. Everything lands
#    in $OUT (or /tmp/gpu_out): logs, cuda_more.npz, gpu.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "no wheels: run tools/gpu_wheels.sh first and carry .whl" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
if [ -n "${CAPTURE:-}" ]; then
    timeout 180 python3 "$CAPTURE" "$out/cuda_more.npz" 2>&1 | tee "$out/capture.log"
fi
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/slow/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
read -r -a bench_args <<< "${BENCH_ARGS:-}"  # e.g. BENCH_ARGS="--accum 8 --modes none,shadow"
timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/bench_gpu.py --json "$out/gpu.json" "${bench_args[@]}" 2>&1 \
    | tee "$out/bench.log"
