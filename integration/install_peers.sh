#!/usr/bin/env bash
# Install the DeepSpeed peer on the GPU machine, offline, from .carry/wheels/ (made by prepare_wheels.sh here).
# Every device call may get a fresh machine, so run this at the start of each call that benchmarks DeepSpeed:
#
#   bash integration/install_peers.sh && python integration/bench_vs_deepspeed.py --systems deepspeed ...
#
# About 30-60 s (the sdist builds with DS_BUILD_OPS=0: no CUDA ops are compiled here). DeepSpeedCPUAdam then
# JIT-compiles with ninja on first use (~1-2 min, inside the first DeepSpeed run). Set PREBUILD_CPU_ADAM=1 to
# compile it here instead (same cost, but outside the benchmark's subprocess timeout).
# If the interpreter's site-packages is not writable, everything goes to /tmp/bench_peers_site, which
# bench_vs_deepspeed.py puts on its runners' PYTHONPATH by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
W=.carry/wheels
PY="${PYTHON:-python3}"
TARGET_DIR=/tmp/bench_peers_site
if ! ls $W/deepspeed-*.tar.gz >/dev/null 2>&1; then
  echo "no DeepSpeed sdist in $W: run integration/prepare_wheels.sh on a machine with network, carry .carry" >&2
  exit 1
fi
t0=$(date +%s)
pipi() { "$PY" -m pip install -q --no-index --find-links "$W" --no-cache-dir --disable-pip-version-check "$@"; }
if "$PY" -c "import deepspeed" 2>/dev/null; then
  echo "deepspeed already importable"
elif pipi pydantic hjson && DS_BUILD_OPS=0 pipi --no-build-isolation --no-deps $W/deepspeed-*.tar.gz; then
  echo "installed into $("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
else
  echo "falling back to --target $TARGET_DIR" >&2
  pipi --target "$TARGET_DIR" pydantic hjson
  DS_BUILD_OPS=0 pipi --no-build-isolation --no-deps --target "$TARGET_DIR" $W/deepspeed-*.tar.gz
  export PYTHONPATH="$TARGET_DIR${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import deepspeed, pydantic; print('deepspeed', deepspeed.__version__, 'pydantic', pydantic.__version__)"
if [ "${PREBUILD_CPU_ADAM:-0}" = "1" ]; then
  "$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam built')"
fi
echo "install_peers: $(( $(date +%s) - t0 )) s"
