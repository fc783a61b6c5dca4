#!/usr/bin/env bash
# Download what the GPU machine lacks for the DeepSpeed peer into .carry/wheels/ (gitignored; pass `.carry` in
# the device tool's `carry`). The GPU machine has no network: DeepSpeed's pure-Python needs that its image lacks
# (pydantic + pydantic-core + annotated-types + typing-inspection + typing-extensions, hjson) as manylinux
# x86_64 wheels for CPython 3.10/3.11/3.12 (the image's python3 is 3.12; the others are cheap insurance), plus
# the DeepSpeed sdist, which install_peers.sh builds there with DS_BUILD_OPS=0 (ops JIT-compile on first use).
# ninja, py-cpuinfo, msgpack, psutil, einops, numpy, packaging, tqdm are already in the image.
#
#   bash integration/prepare_wheels.sh            # DeepSpeed 0.19.8 (the published reference's version)
#   DS_VERSION=0.18.0 bash integration/prepare_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DS_VERSION="${DS_VERSION:-0.19.8}"
DEST=.carry/wheels
PY="${PYTHON:-python3}"
mkdir -p "$DEST"

for pyver in 3.10 3.11 3.12; do
  "$PY" -m pip download -q --only-binary=:all: --implementation cp --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST" pydantic hjson
done
# The sdist, not a wheel: built on the GPU machine against its own torch.
"$PY" -m pip download -q --no-deps --no-binary deepspeed -d "$DEST" "deepspeed==${DS_VERSION}"

# One version of each package: a stale second version would make the offline install ambiguous.
for name in pydantic pydantic_core annotated_types typing_inspection typing_extensions hjson deepspeed; do
  n=$(ls "$DEST" | grep -i "^${name}-" | sed -E 's/^([^-]+)-([^-]+)(-.*|\.tar\.gz)$/\2/' | sort -u | wc -l)
  if [ "$n" -gt 1 ]; then
    echo "warning: $n versions of $name in $DEST; delete the stale ones" >&2
  fi
done
ls -la "$DEST"
du -sh "$DEST"
