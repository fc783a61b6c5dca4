#!/usr/bin/env bash
# Wheels of the fused cross-entropy libraries (loss_impl liger / cce) for the GPU machine, which has no network:
# pure-Python wheels (their Triton kernels compile there; the CUDA torch image brings triton), no dependencies.
# Into .carry/wheels/ (gitignored; pass `.carry` in the device tool's `carry`), then on the GPU machine:
#
#   bash integration/prepare_loss_wheels.sh
#   pip install --no-deps .carry/wheels/liger_kernel-*.whl .carry/wheels/cut_cross_entropy-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.carry/wheels
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" \
  "liger-kernel${LIGER_VERSION:+==$LIGER_VERSION}" "cut-cross-entropy${CCE_VERSION:+==$CCE_VERSION}"
ls -la "$DEST" | grep -Ei "liger|cut_cross" || true
