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
