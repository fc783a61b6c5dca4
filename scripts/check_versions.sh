#!/usr/bin/env bash
# Run the CPU test suite against another set of dependency versions, in its own venv (.venv-<mode>), so drift is
# found by us before users find it. Run before ending a working session; the result is filed under
# integration/results/versions/<mode>.txt (versions + pytest summary).
#
#   bash scripts/check_versions.sh newest   # the newest releases of torch, transformers, accelerate, peft, trl,
#                                           # datasets, safetensors the registry resolves today (no constraints)
#   bash scripts/check_versions.sh oldest   # the lowest versions pyproject.toml declares (>= bounds)
#   bash scripts/check_versions.sh tested   # constraints.txt, what scripts/setup.sh and CI install
#
# Extra arguments go to pytest (e.g. `-x tests/test_trl.py`). When `newest` passes, refresh the tested set with
#   .venv-newest/bin/python -m pip freeze --exclude-editable | sed 's/+cpu$//' > constraints.txt   (keep its header)
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-newest}"; shift || true
venv=".venv-${mode}"
python3 -m venv --clear "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
case "$mode" in
  newest)
    # torch: the newest release this machine's pip may take (CPU machines here cap it, see the README)
    python -m pip install -q --upgrade torch
    python -m pip install -q --upgrade -e ".[test,examples,trl]" transformers accelerate peft trl datasets \
        safetensors evaluate tokenizers huggingface_hub
    ;;
  oldest)
    lows=$(python - <<'EOF'
import re, tomllib
data = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = data["dependencies"] + [r for k in ("test", "examples", "trl", "peft") for r in data["optional-dependencies"][k]]
pins = {}
for r in reqs:
    m = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)", r)
    if m and m.group(1) != "torch":  # torch: the tested pin (one CPU build is on disk here)
        pins[m.group(1).lower()] = m.group(2)
print(" ".join(f"{k}=={v}" for k, v in sorted(pins.items())))
EOF
)
    echo "oldest declared: $lows"
    python -m pip install -q -c constraints.txt "torch==2.13.0"
    python -m pip install -q -e ".[test,examples,trl]" $lows "torch==2.13.0"
    ;;
  tested)
    bash scripts/setup.sh
    ;;
  *) echo "usage: $0 newest|oldest|tested [pytest args]"; exit 2 ;;
esac
out="integration/results/versions/${mode}.txt"
mkdir -p "$(dirname "$out")"
{
  echo "# scripts/check_versions.sh $mode $* -- $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  python -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|trl|datasets|safetensors|evaluate|tokenizers|huggingface.hub)=='
} > "$out"
set +e
python -m pytest -q -n 2 -m "not gpu" -p no:cacheprovider "${@:-tests}" 2>&1 | tee /tmp/check_versions_$mode.log | tail -25
rc=${PIPESTATUS[0]}
set -e
{ echo "# pytest exit code: $rc"; grep -E '^(FAILED|ERROR)|passed|failed' /tmp/check_versions_$mode.log | tail -40; } >> "$out"
echo "filed: $out (pytest exit code $rc)"
exit "$rc"
