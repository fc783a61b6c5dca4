"""The user documentation stays true to the code: docs/configuration.md is what scripts/gen_config_doc.py generates
from MegaTrainConfig, the README stays short and keeps the two fresh-machine commands CI and checks parse, and every
relative link in the README and docs/ names a file of the repository."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

SETUP = "python3 -m venv .venv && . .venv/bin/activate && bash scripts/setup.sh"
TRAIN = f"{SETUP} && python examples/train.py"
TESTS = f'{SETUP} && python -m pytest -q -n 2 -m "not gpu" tests'


def _gen():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_doc
    finally:
        sys.path.pop(0)
    return gen_config_doc


def test_configuration_doc_is_generated_from_the_code():
    gen = _gen()
    assert gen.OUT.read_text() == gen.render(), \
        "docs/configuration.md is stale: run python scripts/gen_config_doc.py"


def test_configuration_doc_names_every_key():
    from hf_megatrain.config import MegaTrainConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    for key in MegaTrainConfig.valid_keys():
        assert f"\n### {key}\n" in text, key


def test_readme_is_short_and_keeps_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    lines = [line.strip() for line in text.splitlines()]
    assert TRAIN in lines and TESTS in lines  # each on a line of its own, exactly


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    for part in ("python3 -m venv .venv", ". .venv/bin/activate", "bash scripts/setup.sh",
                 'python -m pytest -q -n 2 -m "not gpu" tests'):
        assert part in ci, part


LINK = re.compile(r"\]\(([^)\s#]+)(#[^)]*)?\)")


def test_relative_links_resolve():
    docs = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "integration" / "PERF.md"]
    broken = []
    for doc in docs:
        for target, _ in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_docs_named_in_code_exist():
    """Messages, docstrings and scripts that send the reader to docs/<name>.md name a file that exists."""
    named = set()
    for folder in ("hf_megatrain", "tests", "integration", "scripts", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            named |= {(path.relative_to(ROOT), m) for m in re.findall(r"docs/[\w.-]+\.md", path.read_text())}
    missing = [f"{p}: {m}" for p, m in sorted(named) if not (ROOT / m).exists()]
    assert not missing, missing
