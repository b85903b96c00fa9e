#!/usr/bin/env bash
# Quick start 1/2: install, then crash and restore a DDP run (see examples/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/demo.py "$@"
