#!/usr/bin/env bash
# The whole suite on a machine with many cores, as N machines like the CI's would run it: N xdist
# workers, each pinned to 2 CPUs of its own (scripts/pytest_two_cpus.py), so a kernel variant's
# tests see the 2-thread pool they see in CI. Made for the GPU machine's 16-core AMX host (issue 23:
# the suite with AMX selected ran there in ~3 minutes), with what .whl/ carries installed first
# (scripts/device_wheels.sh) where the interpreter lacks it.
#   bash scripts/suite_shards.sh [N] [pytest args]     (default N: CPUs / 2)
#   HETMOE_ISA=amx bash scripts/suite_shards.sh 8 tests  # AMX selected for every test
# PYTHON picks the interpreter (default .venv/bin/python where it exists, else python3); OUT a
# folder for the JUnit report (default: none written).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
n=${1:-$(($(nproc) / 2))}
shift || true
# shellcheck source=scripts/carried_wheels.sh
. scripts/carried_wheels.sh
install_carried_wheels "$PY"
"$PY" -c "import xdist" 2>/dev/null || { echo "suite_shards: $PY has no pytest-xdist (scripts/device_wheels.sh carries it)"; exit 2; }
export PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=2
report=()
[ -n "${OUT:-}" ] && report=(--junitxml="$OUT/suite.xml")
"$PY" -m pytest -q -p pytest_two_cpus -n "$n" -o cache_dir=/tmp/hetmoe-pytest-cache -rfE "${report[@]}" "${@:-tests}"
