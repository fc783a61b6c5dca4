#!/usr/bin/env bash
# Install timm + pillow (+ torchvision, which timm imports) BESIDE the tested set, for the family sweep's gemma3n
# entries (transformers builds Gemma 3n's vision tower as TimmWrapperModel, which needs timm and PIL):
#
#   bash integration/install_timm_site.sh [/tmp/timm_site]
#   .venv/bin/python integration/family_sweep.py --extra-site /tmp/timm_site --families gemma3n,gemma3n+image \
#       --append --out integration/results/family_sweep/family_sweep_cpu.jsonl
#
# Nothing goes into the venv: `pip install --no-deps --target DIR`. The torchvision matching torch 2.13 is 0.28.x;
# its PyPI Linux wheel is a CUDA build whose _C.so links libtorch_cuda / libc10_cuda, which the CPU torch lacks, and
# its _meta_registrations.py registers fake kernels for torchvision::nms / qnms unconditionally, so `import
# torchvision` fails ("operator torchvision::nms does not exist"). timm only needs torchvision's Python parts
# (FrozenBatchNorm2d, transforms), so the CUDA libraries are removed and those two registrations made conditional
# on the C++ ops being loaded, as the file's other registrations already are. The sweep's records name what an
# entry imported from DIR (extra_libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-/tmp/timm_site}"
PY="${PYTHON:-.venv/bin/python}"
TV="$("$PY" -c 'import torch; v = torch.__version__.split("+")[0].split("."); print(f"0.{int(v[1]) + 15}.*")')"
WHEELS="$(mktemp -d)"
"$PY" -m pip download -q --no-deps -d "$WHEELS" timm pillow "torchvision==$TV"
"$PY" -m pip install -q --no-deps --upgrade --target "$DIR" "$WHEELS"/*.whl
rm -rf "$WHEELS" "$DIR"/torchvision/*.so "$DIR"/torchvision.libs
sed -i 's/^@torch.library.register_fake(\(.*\))$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
  "$DIR"/torchvision/_meta_registrations.py
PYTHONPATH="$DIR" "$PY" -c 'import torch, torchvision, timm, PIL
print("torch", torch.__version__, "torchvision", torchvision.__version__, "timm", timm.__version__, "pillow", PIL.__version__)'
