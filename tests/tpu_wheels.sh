#!/usr/bin/env bash
# The wheels fsm-pd needs on a TPU host that reaches no package index (docs/tpu.md, "Running there"): run
# `bash tests/tpu_wheels.sh` here, on a machine that reaches PyPI, carry the folder over, and install it there with
# the command docs/tpu.md gives. Wheels for CPython 3.11 on x86-64 glibc (the v5e host: glibc 2.36), each without its
# dependencies: the list below is the whole closure, checked on that host. The host's own jax and jaxlib (with
# libtpu) stay first on its path, so they are not here; nor are pytest and hypothesis, which it has. pytest-xdist,
# execnet and psutil are for the tests' plugins (pyproject's addopts name xdist's options), pytest-timeout for the
# 300 s bound of each test. About 22 MiB.
#
#   bash tests/tpu_wheels.sh [DIR]      # default .whl-tpu (git ignores it)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl-tpu}

serving=(
  transitions six pyzmq msgpack sqlalchemy fastapi starlette pydantic pydantic-core annotated-types
  typing-inspection uvicorn h11 click orjson httpx httpcore anyio sniffio idna certifi rich markdown-it-py mdurl
  pygments prometheus-client safetensors tokenizers jinja2 markupsafe gguf pyyaml tqdm llguidance crc32c
  annotated-doc opentelemetry-api importlib-metadata zipp typing-extensions huggingface-hub filelock fsspec
  packaging requests urllib3 charset-normalizer
)
tests=(pytest-xdist execnet psutil pytest-timeout)

platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
           manylinux_2_26_x86_64 manylinux_2_31_x86_64; do
  platforms+=(--platform "$tag")
done

python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 --implementation cp "${platforms[@]}" \
  -d "$dest" "${serving[@]}" "${tests[@]}"
echo "tests/tpu_wheels.sh: $(find "$dest" -name '*.whl' | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
