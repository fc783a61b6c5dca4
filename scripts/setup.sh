#!/usr/bin/env bash
# Install hf_megatrain and its test/example/trl extras into the active Python environment, at the tested set of
# versions (constraints.txt: what CI passes with), so a fresh machine reproduces CI. To try the newest releases
# instead, run scripts/check_versions.sh newest (its own venv).
# torch is pinned: on CPU-only machines with a local wheel cache this takes the CPU build in seconds;
# on a GPU box the same pin installs the CUDA build from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt "torch==2.13.0"
python -m pip install -q -c constraints.txt -e ".[test,examples,trl]"
