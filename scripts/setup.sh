#!/usr/bin/env bash
# Install shadow and its dependencies into the current Python.
# torch is pinned first when missing so that pip never resolves a (multi-GB) CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test]"
