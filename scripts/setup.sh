#!/usr/bin/env bash
# Install shadow and its dependencies into the current Python.
#   scripts/setup.sh            everything (the quick start and CI): the trainer extra (torch,
#                               safetensors), the test tools and the frameworks the integrations
#                               are tested with, and the UCX data path, ".[test,accelerate,hf,lightning,ucx]"
#   scripts/setup.sh service    a service-only host (coordinator, workers, status, ls, verify): no torch
# torch is pinned first when missing so that pip never resolves a (multi-GB) CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-all}" in
    all) ;;
    service)
        "$PY" -m pip install --quiet -e .
        exit 0
        ;;
    *)
        echo "usage: scripts/setup.sh [service]" >&2
        exit 2
        ;;
esac
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test,accelerate,hf,lightning,ucx]"
