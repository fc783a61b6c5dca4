"""integration/probes/pick_config.py: a device queue picks the config whose multi-process bench ran fastest, and a
candidate that failed or missed a run never wins."""

from __future__ import annotations

import importlib.util
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _probe():
    path = os.path.join(HERE, "..", "integration", "probes", "pick_config.py")
    spec = importlib.util.spec_from_file_location("pick_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench(folder, times: dict[str, float], status: str = "ok") -> str:
    os.makedirs(folder, exist_ok=True)
    records = {"m:streamed@16": {"status": "ok", "processes": 1, "step_time_s": 0.5}}
    records.update({k: {"status": status, "processes": 2, "step_time_s": t} for k, t in times.items()})
    with open(os.path.join(folder, "bench_vs_deepspeed_h200.json"), "w") as f:
        json.dump({"records": records}, f)
    return str(folder)


def test_the_fastest_complete_candidate_wins(tmp_path, capsys):
    pick = _probe()
    both = {"m:streamed@8x2": 0.7, "m:streamed@16x2": 1.1}
    a = _bench(tmp_path / "a", both)
    b = _bench(tmp_path / "b", {"m:streamed@8x2": 0.69, "m:streamed@16x2": 1.09})
    c = _bench(tmp_path / "c", {"m:streamed@8x2": 0.5})  # (missed the 32k run: loses whatever its 16k)
    d = _bench(tmp_path / "d", {"m:streamed@8x2": 0.1, "m:streamed@16x2": 0.1}, status="failed")
    assert pick.main([f"{a}={{}}", f'{b}={{"host_threads": 12}}', f'{c}={{"x": 1}}', f'{d}={{"y": 1}}']) == 0
    assert json.loads(capsys.readouterr().out) == {"host_threads": 12}


def test_a_tie_or_nothing_usable_keeps_the_first(tmp_path, capsys):
    pick = _probe()
    a = _bench(tmp_path / "a", {"m:streamed@16x2": 1.1})
    b = _bench(tmp_path / "b", {"m:streamed@16x2": 1.1})
    assert pick.main([f"{a}={{}}", f'{b}={{"host_threads": 12}}']) == 0
    assert json.loads(capsys.readouterr().out) == {}
    assert pick.main([f"{tmp_path / 'none'}", f'{tmp_path / "nothing"}={{"x": 1}}']) == 0
    assert json.loads(capsys.readouterr().out) == {}
