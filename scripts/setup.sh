#!/usr/bin/env bash
# Set up ./.venv: torch first (2.13.0, a CPU build on this project's machines), then hetmoe itself.
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --dev    # plus the test and lint tools
# GPU users: create .venv, install the CUDA torch build for your driver into it first; this script
# keeps any torch already present (or set HETMOE_SKIP_TORCH=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
quiet python -m pip install -q --upgrade pip
if [ -z "${HETMOE_SKIP_TORCH:-}" ] && ! python -c "import torch" 2>/dev/null; then
  quiet python -m pip install -q torch==2.13.0
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
quiet python -m pip install -q -e ".${extra}"
