"""Checkpoint keys -> model names through transformers' own conversion mapping, one target tensor at a time.

``save_pretrained`` of transformers 5 writes some models in a legacy layout (MoE experts one tensor per expert,
renamed modules) while the model in memory has fused experts; transformers converts on load with the
``WeightRenaming`` / ``WeightConverter`` list of ``transformers.conversion_mapping.get_model_conversion_mapping``.
This module applies that same list, generically, without a state dict: it plans from the safetensors headers
(names, shapes) which checkpoint keys feed which model tensor, checks the plan on meta tensors (names and shapes,
nothing read), then runs each converter's own operations on the few source tensors of one target at a time.

Core module: torch only at import time; transformers is imported lazily, and only when a mapping is given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from .names import CheckpointError

__all__ = ["ConvertGroup", "KeyPlan", "plan_keys", "run_group"]


@dataclass
class ConvertGroup:
    """One converter instance: the checkpoint keys it reads and the model names it writes."""
    converter: Any                       # a transformers WeightConverter (template; deep-copied per run)
    first_target: str                    # the name transformers keys the group by (its first target)
    sources: list[tuple[str, str, str]] = field(default_factory=list)  # (source pattern, checkpoint key, file)
    targets: list[str] = field(default_factory=list)


@dataclass
class KeyPlan:
    direct: dict[str, str] = field(default_factory=dict)       # checkpoint key -> model name (same or renamed)
    groups: list[ConvertGroup] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)          # keys neither direct nor converted

    @property
    def converted_keys(self) -> set[str]:
        return {key for g in self.groups for _, key, _ in g.sources}


def plan_keys(shards: dict[str, list[str]], targets: Iterable[str], weight_mapping: list | None,
              base_model_prefix: str | None = None) -> KeyPlan:
    """Which checkpoint key feeds which model name. A key already named as in the model is taken as is (the
    layout hf_megatrain's own export writes); the others go through transformers' renamings, then at most one
    converter, exactly as ``transformers.core_model_loading.rename_source_key`` does."""
    targets = set(targets)
    plan = KeyPlan()
    file_of = {key: fname for fname, names in shards.items() for key in names}
    if not weight_mapping:
        for key in file_of:
            if key in targets:
                plan.direct[key] = key
            else:
                plan.unmatched.append(key)
        return plan
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [t for t in weight_mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in weight_mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    present = dict.fromkeys(targets, True)
    groups: dict[str, ConvertGroup] = {}
    for key in sorted(file_of, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10 (not 0, 1, 10)
        if key in targets:
            plan.direct[key] = key
            continue
        renamed, pattern = rename_source_key(key, renamings, converters, base_model_prefix, present)
        if renamed not in targets:
            plan.unmatched.append(key)
        elif pattern is None:
            plan.direct[key] = renamed
        else:
            conv = by_pattern[pattern]
            g = groups.get(renamed)
            if g is None:
                g = groups[renamed] = ConvertGroup(conv, renamed, targets=[
                    renamed.replace(conv.target_patterns[0], t) for t in conv.target_patterns])
            g.sources.append((pattern, key, file_of[key]))
    plan.groups = list(groups.values())
    return plan


def run_group(group: ConvertGroup, read: Callable[[str, str], torch.Tensor], *, model: Any = None,
              config: Any = None) -> dict[str, torch.Tensor]:
    """Apply ``group``'s converter to its sources (``read(file, key)`` gives each one); {model name: tensor}."""
    conv = copy.deepcopy(group.converter)
    for pattern, key, fname in group.sources:
        conv.add_tensor(group.first_target, key, pattern, (lambda f=fname, k=key: read(f, k)))
    try:
        out = conv.convert(group.first_target, model=model, config=config)
    except Exception as e:
        raise CheckpointError(f"converting checkpoint tensors {[k for _, k, _ in group.sources][:4]}... into "
                              f"{group.first_target} with transformers' {group.converter} failed: {e}") from e
    return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}
