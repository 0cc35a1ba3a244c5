#!/usr/bin/env bash
# Fill .whl/ with the wheels a machine without this project's dependencies needs to run its tests,
# at the versions installed in ./.venv (the tested ones): the GPU machine lent to some tasks has its
# own Python (3.12, a CUDA torch, transformers 5.17) and cannot reach a package index. Pure-Python
# wheels once, compiled ones for the CPython versions in DEVICE_PYTHONS (default 3.12, the device's;
# all four of 3.10-3.13 come to 53 MB, which with the tree passes the device run's 64 MiB carry
# limit); scripts/gpu_check.sh, scripts/suite_shards.sh and scripts/amx_check.sh install the ones
# that fit the interpreter, into /tmp/site.
#   bash scripts/device_wheels.sh [DIR]        (default .whl; ~33 MB)
# .whl/ is git-ignored: hand it to the device run as a carried path (carry: [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=.venv/bin/python
[ -x "$py" ] || { echo "no $py: run bash scripts/setup.sh --dev first" >&2; exit 2; }
mkdir -p "$dest"
# The packages a device run was found to lack (2026-12-04): transformers and its hub client stack,
# the GGUF reader, the server's stack, the test tools.
pure="transformers huggingface_hub httpx2 httpcore2 h11 idna truststore certifi anyio sniffio typing_extensions
  filelock fsspec tqdm packaging typer click rich shellingham markdown-it-py mdurl pygments gguf fastapi
  starlette annotated-doc opentelemetry-api uvicorn openai httpx httpcore pydantic annotated-types
  typing-inspection distro peft accelerate compressed-tensors loguru pytest-xdist execnet"
compiled="tokenizers safetensors regex pydantic-core jiter psutil hf-xet kernels"
pin() {  # name==version as installed in the venv; the newest release where the venv lacks it (xdist)
  "$py" -c "import importlib.metadata as m, sys
try: print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')
except m.PackageNotFoundError: print(sys.argv[1])" "$1"
}
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pins=$(for p in $pure; do pin "$p"; done)
quiet "$py" -m pip download -q --no-deps -d "$dest" $pins
for v in ${DEVICE_PYTHONS:-3.12}; do
  for p in $compiled; do
    spec=$(pin "$p")
    quiet "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$dest" "$spec" ||
      echo "device_wheels: no $spec wheel for CPython $v" >&2
  done
done
echo "$(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
