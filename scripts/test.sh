#!/usr/bin/env bash
# Quick start 2/2: install, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q --durations=40 "$@"
