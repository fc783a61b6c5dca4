"""The checkpointed state of ``UnitAdamW`` (optim/adamw.py): per-unit moments and step counts as flat tensors, and
the scheduler-visible hyper-parameters as JSON (checkpoint/ writes and reads both).

A mixin over the optimizer's own attributes: ``store`` (the units whose ``exp_avg`` / ``exp_avg_sq`` it holds),
``counts`` (optim/step_counts.py), ``device_stepper``, ``ranks`` and ``own`` (data parallel: each rank fills its
shard of the shared state), ``param_groups``, ``skipped_steps``, ``policy`` (speculation), ``wait()``.
"""

from __future__ import annotations

import torch


class AdamWStateIO:
    """State in and out of the optimizer (see the module docstring for the attributes it reads)."""

    @property
    def unit_steps(self) -> torch.Tensor:
        """AdamW step count per unit."""
        return self.counts.state_tensors()["unit_steps"]

    @property
    def missed_steps(self) -> dict[int, list[int]]:
        """Per unit some of whose parameters skipped steps (no gradient reached them, as torch.optim.AdamW skips a
        None ``.grad``): each parameter's skipped steps (its own step count is the unit's minus that). A copy."""
        return self.counts.missed()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        self.wait()
        counts = self.counts.state_tensors()  # (unit_steps, then per-parameter skipped steps where there are some)
        out = {"unit_steps": counts.pop("unit_steps")}
        for u in self.store.units:
            out[f"exp_avg.{u.index}"] = u.exp_avg
            out[f"exp_avg_sq.{u.index}"] = u.exp_avg_sq
        out.update(counts)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.wait()
        if self.device_stepper is not None:
            self.device_stepper.forget()
        self.counts.load_state_tensors(tensors)
        for u in self.store.units:
            lo, hi = self.own(u)  # (data parallel: each rank fills its shard of the shared state)
            for key, dst in ((f"exp_avg.{u.index}", u.exp_avg), (f"exp_avg_sq.{u.index}", u.exp_avg_sq)):
                src = tensors[key]
                if src.shape != dst.shape:
                    raise ValueError(f"optimizer state {key}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
                dst[lo:hi].copy_(src[lo:hi])
        self.ranks.barrier()

    def hyper_state(self) -> dict:
        """Scheduler-visible state (LRs etc.) and the speculation mode, JSON-serialisable."""
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "skipped_steps": self.skipped_steps, "speculate_norm_first": self.policy.norm_first}

    def load_hyper_state(self, state: dict) -> None:
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.policy.norm_first = bool(state.get("speculate_norm_first", self.policy.norm_first))
