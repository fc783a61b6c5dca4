"""integration/bench/record.py: the header every benchmark result carries (command, commit, date, machine,
versions), the atomic writer, and filing a result under integration/results/'s ``<date>_<commit>_<run>`` name."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "integration"))

from bench import record  # noqa: E402


def test_header_names_the_command_commit_machine_and_versions(monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    h = record.header(os.path.join(ROOT, "integration", "scale_123b.py"), ["--tiny", "--out", "a b"])
    assert list(h) == ["command", "commit", "date", "machine", "versions"]
    assert h["command"] == "python integration/scale_123b.py --tiny --out 'a b'"
    assert h["commit"] == "abc1234"
    m = h["machine"]
    assert m["cpu_count"] >= 1 and m["mem_total_gib"] > 0 and "gpu" in m and "gpu_count" in m
    assert h["versions"]["torch"] and "transformers" in h["versions"]
    # a script's own --commit wins over the environment (a tree copied without .git, or with a stale one)
    assert record.header("x.py", [], given_commit="def5678", host={})["commit"] == "def5678"
    assert record.command("integration/bench_dpo.py", ["--tiny"], called="bench_dpo") == "bench_dpo.main(--tiny)"


def test_commit_falls_back_to_the_checkout(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    c = record.commit()
    if os.path.isdir(os.path.join(ROOT, ".git")):
        assert c and all(ch in "0123456789abcdef" for ch in c)


def test_write_puts_json_and_markdown_in_place(tmp_path):
    path = tmp_path / "sub" / "bench_x.json"
    record.write(str(path), {"a": 1, "when": object()}, "# table\n")
    assert json.loads(path.read_text())["a"] == 1  # (anything else as its str)
    assert (tmp_path / "sub" / "bench_x.md").read_text() == "# table\n"
    record.write(str(path), {"a": 2})
    assert json.loads(path.read_text())["a"] == 2 and (tmp_path / "sub" / "bench_x.md").exists()
    assert not [p for p in os.listdir(tmp_path / "sub") if p.endswith(".tmp")]


def test_filing_a_result_under_its_date_and_commit(tmp_path):
    res = tmp_path / "bench_vs_deepspeed_h100.json"
    record.write(str(res), {"date": "2026-11-27 10:00:00", "commit": "abc1234", "records": {}}, "md\n")
    assert record.main(["file", str(res), "streamed_clip1_h100", str(tmp_path / "filed")]) == 0
    assert sorted(os.listdir(tmp_path / "filed")) == ["2026-11-27_abc1234_streamed_clip1_h100.json",
                                                      "2026-11-27_abc1234_streamed_clip1_h100.md"]
    with pytest.raises(ValueError, match="no commit"):
        record.filed_name({"date": "2026-11-27"}, "x")
