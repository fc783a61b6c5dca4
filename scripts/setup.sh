#!/usr/bin/env bash
# Install hf_megatrain and its test/example/trl extras into the active Python environment (trl: the TRL
# integration's tests run in CI).
# torch is pinned: on CPU-only machines with a local wheel cache this takes the CPU build in seconds;
# on a GPU box the same pin installs the CUDA build from PyPI.
set -euo pipefail
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,examples,trl]"
