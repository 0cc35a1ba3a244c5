# Sourced by scripts/gpu_check.sh and scripts/suite_shards.sh: install_carried_wheels PY installs
# each wheel of .whl/ (scripts/device_wheels.sh) that fits interpreter PY into /tmp/site, one at a
# time (the compiled ones for other CPython versions do not install), and puts /tmp/site first on
# PYTHONPATH; without .whl/ it does nothing.
install_carried_wheels() {
  compgen -G ".whl/*.whl" >/dev/null || return 0
  mkdir -p /tmp/site
  local w
  for w in .whl/*.whl; do
    "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
      >/dev/null 2>&1 || true
  done
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
}
