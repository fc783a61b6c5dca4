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
