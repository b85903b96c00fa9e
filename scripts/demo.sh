#!/usr/bin/env bash
# Quick start 1/2: install, then crash and restore a DDP run (see scripts/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" scripts/demo.py "$@"
