"""What the TRL trainer parity tests (DPO, GRPO) compare: logged metrics and trained weights, plain vs ours."""

from __future__ import annotations

import torch


def logs(trainer, key: str = "loss") -> list[dict]:
    """The numeric entries of every log line holding ``key`` (training: "loss"; evaluation: "eval_loss"), without
    the timings."""
    return [{k: v for k, v in h.items() if isinstance(v, (int, float)) and k not in ("epoch", "learning_rate")
             and not k.endswith(("_runtime", "_per_second", "step_time"))}
            for h in trainer.state.log_history if key in h]


def trained(trainer) -> dict[str, torch.Tensor]:
    """Every trainable parameter by name, FP32 (the engine's masters; the plain model's parameters)."""
    if getattr(trainer, "engine", None) is not None:
        return {n: t.detach().float().cpu().clone() for n, t in trainer.engine.named_master_tensors()}
    return {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_resume_is_exact(trainer, tmp_path, rel_tol: float, keys: tuple[str, ...] = ("loss",)) -> None:
    """``trainer(out, **args)`` builds a fresh trainer writing to ``out``: three steps uninterrupted, and three
    steps resumed from the checkpoint saved at step 2, end with the same weights and the same last logged ``keys``."""
    import pytest

    whole = trainer(tmp_path / "whole")
    whole.train()
    first = trainer(tmp_path / "cut", save_strategy="steps", save_steps=2)
    first.train()
    resumed = trainer(tmp_path / "cut", save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    want, got = trained(whole), trained(resumed)
    assert sorted(want) == sorted(got)
    for n in want:
        assert rel(got[n], want[n]) < rel_tol, (n, rel(got[n], want[n]))
    for k in keys:
        assert logs(resumed)[-1][k] == pytest.approx(logs(whole)[-1][k], rel=rel_tol), k


def check_trainers_match(ref, ours, required: tuple[str, ...], rel_tol: float) -> tuple[list[dict], list[dict]]:
    """Plain ``ref`` and our ``ours`` after the same training: every evaluation and training log entry within
    ``rel_tol`` (3 training log lines, the same keys, ``required`` among them) and every trained weight. Returns
    (our eval logs, our training logs) for the caller's own checks."""
    import pytest

    our_eval = logs(ours, "eval_loss")
    for r, o in zip(logs(ref, "eval_loss"), our_eval, strict=True):
        assert sorted(r) == sorted(o)
        for k in r:
            assert o[k] == pytest.approx(r[k], rel=rel_tol, abs=1e-6), (k, o[k], r[k])
    ref_logs, our_logs = logs(ref), logs(ours)
    assert len(our_logs) == 3 and [sorted(r) for r in ref_logs] == [sorted(o) for o in our_logs]
    for key in required:
        assert key in our_logs[0], key
    for r, o in zip(ref_logs, our_logs):
        for k in r:
            assert o[k] == pytest.approx(r[k], rel=rel_tol, abs=1e-6), (r["step"], k, o[k], r[k])
    want, got = trained(ref), trained(ours)
    assert sorted(want) == sorted(got)
    for n in want:
        assert rel(got[n], want[n]) < rel_tol, (n, rel(got[n], want[n]))
    return our_eval, our_logs
