#!/usr/bin/env bash
# The AMX kernels on a machine that has AMX (the GPU machine's host has): build there, run
# tests/test_amx.py and the pytest arguments in AMX_CHECK_TESTS (the hardware tiles against the
# emulator, bit for bit, and both against float64), then time one Qwen3-30B-A3B MoE layer with
# `hetmoe bench moe` on 2 threads, once per setting of
# AMX_CHECK_SETTINGS (space-separated; "default", or VAR=value[,VAR=value]), alternating,
# AMX_CHECK_ROUNDS times, on the CPUs AMX_CHECK_CPUS lists (taskset's list; default: any).
# Without AMX it stops at once with one line.
#
#   AMX_CHECK_SETTINGS="default HETMOE_AMX_4BIT=codes" bash scripts/amx_check.sh [OUT_DIR]
#
# PYTHON picks the interpreter; .whl/ (scripts/device_wheels.sh) supplies what it lacks.
# AMX_CHECK_BENCH overrides bench moe's arguments (default below: int4, int8, bf16 at 1 and 512 tokens).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${1:-${OUT:-amx-check}}
SETTINGS=${AMX_CHECK_SETTINGS:-default}
ROUNDS=${AMX_CHECK_ROUNDS:-1}
BENCH=${AMX_CHECK_BENCH:---methods int4,int8,bf16 --tokens 1,512 --threads 2 --no-baseline --min-seconds 0.5}
mkdir -p "$DEST"
if ! grep -q -m1 -w amx_tile /proc/cpuinfo; then
  echo "amx_check: this CPU has no AMX; the emulated variant runs in the suite here"
  exit 1
fi
# shellcheck source=scripts/carried_wheels.sh
. scripts/carried_wheels.sh
install_carried_wheels "$PY"
export PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
grep -m1 "model name" /proc/cpuinfo | tee "$DEST/cpu.txt"
start=$(date +%s)
"$PY" setup.py -q build_ext --inplace -j "$(nproc)" >"$DEST/build.log" 2>&1 || { tail -30 "$DEST/build.log"; exit 1; }
echo "built the extension in $(($(date +%s) - start)) s"

# shellcheck disable=SC2086  # AMX_CHECK_TESTS: pytest arguments, split on spaces
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_amx.py ${AMX_CHECK_TESTS:-} 2>&1 | tee "$DEST/tests.log" | tail -5
tests_rc=${PIPESTATUS[0]}

bench_rc=0
: >"$DEST/bench.log"
for round in $(seq 1 "$ROUNDS"); do
  for setting in $SETTINGS; do
    name=${setting//[^A-Za-z0-9_]/_}
    echo "== round $round, $setting" | tee -a "$DEST/bench.log"
    [ "$setting" = default ] && set -- || set -- env ${setting//,/ }
    [ -n "${AMX_CHECK_CPUS:-}" ] && set -- "$@" taskset -c "$AMX_CHECK_CPUS"
    # shellcheck disable=SC2086
    timeout 240 "$@" "$PY" -m hetmoe bench moe $BENCH --json "$DEST/bench-$name-$round.json" >>"$DEST/bench.log" 2>&1 ||
      bench_rc=1
    tail -8 "$DEST/bench.log"
  done
done
echo "amx_check: tests rc $tests_rc, bench rc $bench_rc, $(($(date +%s) - start)) s in all"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
