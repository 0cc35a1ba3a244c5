#!/usr/bin/env bash
# The device paths on a real GPU: every test marked `cuda` (the device-path tests, which also run on
# "cpu" standing in for the device on every machine) and bench/bench_device.py's timing of device
# experts and layerwise prefill on the 4-layer Qwen3-30B-A3B-shaped model. Meant to finish in under
# 8 minutes; without a CUDA device it stops at once with one line.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      (default: $OUT, else gpu-check/)
#
# PYTHON picks the interpreter (default python3: the one holding a CUDA build of torch). Packages
# the machine lacks (transformers at the tested version, gguf, the server's stack, ...) travel as
# wheels in .whl/ (scripts/device_wheels.sh fills it; carry it to the device run), installed into
# /tmp/site first, each that fits the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${1:-${OUT:-gpu-check}}
mkdir -p "$DEST"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: $PY has no torch that sees a CUDA device; nothing to check here (the cpu variants run in the suite)"
  exit 1
fi
# shellcheck source=scripts/carried_wheels.sh
. scripts/carried_wheels.sh
install_carried_wheels "$PY"
export PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$DEST/gpu.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee -a "$DEST/gpu.txt"

start=$(date +%s)
"$PY" setup.py -q build_ext --inplace -j "$(nproc)" >"$DEST/build.log" 2>&1 || { tail -30 "$DEST/build.log"; exit 1; }
echo "built the extension in $(($(date +%s) - start)) s"

timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$DEST/tests.log"
tests_rc=${PIPESTATUS[0]}

timeout 300 "$PY" bench/bench_device.py --device cuda --cache-dir /tmp/hetmoe-bench-models \
  --json "$DEST/bench-device.json" 2>&1 | tee "$DEST/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc $tests_rc, bench rc $bench_rc, $(($(date +%s) - start)) s in all"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
