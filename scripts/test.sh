#!/usr/bin/env bash
# Set everything up (with the dev tools) and run the whole test suite, then ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check hetmoe tests
.venv/bin/python -m pytest -q "$@"
