#!/usr/bin/env bash
# Build hetmoe._C with AddressSanitizer + UndefinedBehaviorSanitizer in a copy of this tree, and run
# the tests that drive the C++ engine against it (run it before a stop that touches csrc/).
#   bash scripts/sanitize.sh                 # the engine, linear, NUMA, fast-decode and boundary tests
#   bash scripts/sanitize.sh tests/test_amx.py -k q4_k   # other tests or pytest arguments
# The copy lives in ${HETMOE_SANITIZE_DIR:-/tmp/hetmoe-sanitize} (the checkout's own build is left
# alone); the first build takes a few minutes, later ones rebuild what changed. Any sanitizer report
# ends the run with a nonzero status (halt_on_error), its stack printed. HETMOE_SANITIZE=address (or
# another -fsanitize= list) builds with those sanitizers only.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${HETMOE_SANITIZE_DIR:-/tmp/hetmoe-sanitize}"
py="$root/.venv/bin/python"
[ -x "$py" ] || { echo "no $py: run bash scripts/setup.sh --dev first" >&2; exit 2; }
mkdir -p "$work"
# the working tree as it is (committed or not), without build outputs
(cd "$root" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$work"
(cd "$work" && HETMOE_SANITIZE="${HETMOE_SANITIZE:-1}" "$py" setup.py -q build_ext --inplace -j "$(nproc)" 2>&1 | grep -v "Deprecat\|corresp\|!!\|\*\*\*\|^\s*$\|license\|By 2027\|See https" || true)
[ -f "$(ls "$work"/hetmoe/_C*.so 2>/dev/null | head -1)" ] || { echo "sanitized build failed" >&2; exit 1; }
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_engine.py tests/test_cpu_linear.py tests/test_numa.py tests/test_fast_decode.py
  tests/test_engine_boundary.py tests/test_cpu_attention.py tests/test_mla_attention.py tests/test_engine_quantize.py)
cd "$work"
PYTHONPATH="$work" "$py" -c "import hetmoe, sys; sys.exit(not hetmoe.__file__.startswith('$work'))" ||
  { echo "the sanitized copy in $work is not the hetmoe Python imports" >&2; exit 1; }
# libasan first in the process (Python itself is not instrumented); leaks: the interpreter's own are
# not ours to judge, so leak checking is off. Reports go to files (pytest captures stderr, and a
# sanitizer that halts ends the process before pytest would print it), shown below on failure.
rm -f "$work"/sanitizer-report.*
status=0
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=23:log_path=$work/sanitizer-report" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=24:log_path=$work/sanitizer-report" \
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$work" \
  "$py" -m pytest -v -p no:cacheprovider "${tests[@]}" | grep -v " PASSED" || status=$?
if ls "$work"/sanitizer-report.* > /dev/null 2>&1; then
  echo "sanitizer reports (the test running when it halted is the last one listed above):" >&2
  cat "$work"/sanitizer-report.* >&2
  exit 1
fi
exit "$status"
