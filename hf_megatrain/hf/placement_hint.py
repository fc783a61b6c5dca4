"""The tokens of one micro-batch, read off the train dataset, for auto placement when the user did not say.

Auto placement (``device_layers`` / ``device_step_layers`` = -1) keeps layers whole on the GPU. Told the tokens of one
micro-batch (``placement_tokens``), it keeps as many as the planner's peak for such a step leaves room for; not told,
it gives them a fixed share of the memory (``device_step_fraction``), which left 3 of 8 layers on the CPU at 8k
tokens on the H100 bench: 0.516 s against 0.390 s with the tokens (integration/PERF.md, lever 16). The config's own
advice was to set it to ``per_device_train_batch_size`` x the longest sequence: a knob a user had to know. This
does it where the dataset says its longest sequence: a ``datasets.Dataset`` with an ``input_ids`` column (what a
Trainer script tokenizes into, and what TRL's SFTTrainer prepares, packed rows included), read from the Arrow
offsets without touching the tokens. The longest row of the backing table (a selected or shuffled view may hide
longer ones: never less than the truth), rounded up to a multiple of 64 (collators may pad to a multiple), times
the per-device batch: an upper bound of a padded, packed or padding-free micro-batch. Anything else (an iterable or
torch dataset, DPO's pair columns, GRPO's prompts): nothing, the share rule as before.
"""

from __future__ import annotations

from typing import Any

from ..config import MegaTrainConfig

ROUND_TO = 64


def longest_row(dataset: Any) -> int | None:
    """The longest ``input_ids`` row of a ``datasets.Dataset`` (its backing table), or None when it has none."""
    try:
        import datasets
        import pyarrow.compute as pc
    except ImportError:
        return None
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in (dataset.column_names or ()):
        return None
    column = dataset.data.column("input_ids")
    try:
        longest = pc.max(pc.list_value_length(column)).as_py()
    except (TypeError, ValueError, NotImplementedError):  # (not a list column: a pre-tensorised or odd layout)
        return None
    return int(longest) if longest else None


def with_placement_tokens(config: MegaTrainConfig, dataset: Any, per_device_batch: int
                          ) -> tuple[MegaTrainConfig, str | None]:
    """``config`` with ``placement_tokens`` read off ``dataset`` (module docstring) where the user left it unset and
    auto placement will use it; with a line saying so for the run summary (None when unchanged)."""
    auto = config.device_layers == -1 or config.device_step_layers == -1
    if "placement_tokens" in config.explicit_keys or not auto or per_device_batch < 1:
        return config, None
    longest = longest_row(dataset)
    if longest is None:
        return config, None
    row = -(-longest // ROUND_TO) * ROUND_TO
    tokens = per_device_batch * row
    note = (f"placement_tokens={tokens} from the train dataset (per_device_train_batch_size {per_device_batch} x "
            f"its longest input_ids row, {longest} tokens, rounded up to {row}); set placement_tokens to override")
    return MegaTrainConfig.from_dict({**config.explicit_dict(), "placement_tokens": tokens}), note
