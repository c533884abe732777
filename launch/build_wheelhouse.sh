#!/usr/bin/env bash
# Build a folder of wheels that installs ds_longseq and DeepSpeed on a machine WITHOUT network
# access (e.g. a GPU node whose image already has torch, transformers and CUDA). Run it on a
# machine with network, in the repo root, with torch installed (DeepSpeed's setup.py imports it):
#
#   bash launch/build_wheelhouse.sh [DIR=wheelhouse] [TARGET_PYTHON=3.12]
#
# then copy DIR to the target and follow docs/OFFLINE_INSTALL.md. What goes in:
#   - ds_longseq (this checkout) and DeepSpeed 0.19.8, built here as pure-Python wheels: DeepSpeed
#     publishes only an sdist; with DS_BUILD_OPS=0 its C++/CUDA ops compile on first use on the
#     target (which needs ninja and, for GPU ops, nvcc there);
#   - DeepSpeed's small dependencies that GPU images often lack (hjson, pydantic and its parts),
#     downloaded as binary wheels for TARGET_PYTHON on manylinux x86-64.
# torch, transformers, numpy, tqdm, matplotlib are NOT included: use the target's own.
set -euo pipefail
DIR=${1:-wheelhouse}
PYV=${2:-3.12}
DEEPSPEED=${DEEPSPEED:-deepspeed==0.19.8}
mkdir -p "$DIR"
python -c "import torch" 2>/dev/null || { echo "build_wheelhouse: torch must be installed here (DeepSpeed's setup.py imports it)" >&2; exit 2; }

DS_BUILD_OPS=0 python -m pip wheel --no-deps --no-build-isolation -w "$DIR" "$DEEPSPEED"
python -m pip wheel --no-deps --no-build-isolation -w "$DIR" .
# with their dependencies, so pip picks the pydantic-core that this pydantic pins
python -m pip download --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" hjson "pydantic>=2"
echo "wheelhouse ready: $DIR"
ls -1 "$DIR"
