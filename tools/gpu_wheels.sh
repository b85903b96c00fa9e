#!/usr/bin/env bash
# Wheels for a GPU machine that has torch, numba, msgpack and xxhash but no network and
# none of pyzmq, hydra-core, omegaconf, antlr4 or zstandard (Python 3.12, x86-64). Run
# here, in the repository root; it writes .whl/ (ignored by git through
# .git/info/exclude). There, before the benchmark or the gpu tests:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 benchmarks/bench_gpu.py --json docs/bench/gpu.json
#   python3 -m pytest -q -m gpu tests/slow/test_gpu.py
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    pyzmq==27.3.0 zstandard==0.25.0
# pure Python (antlr4 4.9.3, which omegaconf pins, comes only as a source archive: built here)
python3 -m pip wheel -q --no-deps -w .whl hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
ls -l .whl
