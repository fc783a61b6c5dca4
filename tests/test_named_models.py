"""Named Hub models at their real shapes (integration/named_models.py): every config in integration/hub_configs/
builds on the meta device with the repo's loader to within 2 % of the model's published size, the stored results
are those of today's configs, and docs/models.md is what the script renders from them (no drift)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from integration import named_models  # noqa: E402

FILES = named_models.config_files()


def _results() -> dict:
    return json.loads(named_models.RESULTS.read_text())


def test_configs_exist_and_name_their_source():
    assert len(FILES) >= 15
    for path in FILES:
        meta, values = named_models.load_meta(path)
        assert meta.get("source", "").count("/") == 1, path.name  # a Hub repo id
        assert meta["published_params"] > 1e9 and values.get("model_type"), path.name


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_parameter_count_matches_published_size(path):
    meta, _ = named_models.load_meta(path)
    model = named_models.build(path)
    count = named_models.count_params(model)
    assert abs(count / meta["published_params"] - 1) <= named_models.TOLERANCE, \
        f"{path.name}: {count / 1e9:.2f}B built, {meta['published_params'] / 1e9:.2f}B published"
    recorded = {r["file"]: r for r in _results()["models"]}
    assert recorded[path.name]["params"] == count, \
        f"{path.name} changed since the results were written: run python integration/named_models.py"
    assert recorded[path.name]["status"] == named_models.conversion_status(model)[0], path.name


def test_results_cover_every_config_once():
    assert sorted(r["file"] for r in _results()["models"]) == sorted(p.name for p in FILES)


def test_doc_is_what_the_script_renders():
    text = named_models.DOC.read_text()
    block = text.split(named_models.START, 1)[1].split(named_models.END, 1)[0]
    assert block.strip("\n") == named_models.render(_results()), \
        "docs/models.md is stale: run python integration/named_models.py"
