"""from_pretrained_streamed: a pretrained causal LM straight into the host store, never whole in RAM.

``AutoModelForCausalLM.from_pretrained`` materialises every weight before hf_megatrain could move it to the
store, i.e. a second full copy. Here the HF skeleton is built with parameters on the meta device (buffers such as
rotary tables are computed for real), the engine allocates its store from the skeleton's shapes, and
``checkpoint.load_pretrained_into_engine`` fills the masters shard by shard from the memory-mapped safetensors.
Checkpoints in transformers' legacy layouts (per-expert MoE tensors, renamed modules: what ``save_pretrained`` of
transformers 5 writes for MoE models, and every Hub MoE checkpoint) go through transformers' own conversion
mapping, one target tensor at a time (``checkpoint.convert_keys``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transformers
from torch import nn

from .. import checkpoint as ckpt
from ..config import MegaTrainConfig, resolve_config
from ..engine.model_view import extra_sink
from ..engine.runtime import MegaTrainEngine
from ..model.skeleton import causal_lm_skeleton, materialize_resident
from ..parallel import DataParallel

logger = logging.getLogger(__name__)


def conversion_mapping(model: nn.Module) -> list:
    """transformers' own checkpoint-key conversions for ``model`` (renamed modules, per-expert -> fused experts),
    the list ``from_pretrained`` applies; empty where this transformers has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers < 5: checkpoints are in the in-memory layout
        return []
    return list(get_model_conversion_mapping(model))


def load_weights(engine: MegaTrainEngine, path: str, prefix: str | None = None,
                 mapping: list | None = None, show_progress: bool = True) -> list[str]:
    """Every load of a model checkpoint into an engine (``from_pretrained_streamed``, the Trainer's resume and
    best-model loads): masters, then frozen parameters and buffers (``extra_sink``), with transformers' key
    conversion applied to keys not named as in the model (a ``save_pretrained`` MoE checkpoint's per-expert keys).
    ``mapping`` defaults to the one computed from ``engine.model`` (the same list as from its unconverted skeleton:
    transformers derives it from the model's config and classes). Returns the checkpoint keys not used.
    ``show_progress``: a bar of the bytes read (on a terminal, unless transformers' progress bars are off)."""
    model = engine.model
    sink = extra_sink(engine)
    return ckpt.load_pretrained_into_engine(engine, path, prefix=prefix, extra_sink=sink,
                                            weight_mapping=conversion_mapping(model) if mapping is None else mapping,
                                            extra_names=sink.names,
                                            base_model_prefix=getattr(model, "base_model_prefix", None),
                                            show_progress=show_progress)


def launched_data_parallel() -> DataParallel | None:
    """The data-parallel ranks of this launch (``accelerate launch`` / torchrun with several processes: accelerate's
    state initialises torch.distributed from the launcher), or None for a single process."""
    from accelerate import PartialState

    PartialState()
    return DataParallel.current()


def from_pretrained_streamed(model_id_or_path: str, config: MegaTrainConfig | dict | str | None = None,
                             device: torch.device | str | None = None, decay_names: set[str] | None = None,
                             dp: DataParallel | None | str = "auto", show_progress: bool = True,
                             **hf_kwargs: Any) -> MegaTrainEngine:
    """Build a ``MegaTrainEngine`` for a pretrained causal LM without ever materialising the model in RAM.

    The HF skeleton is built with parameters on the meta device (buffers such as rotary tables are computed for
    real), the engine allocates its host store, and the masters are filled shard by shard from the safetensors
    files (memory-mapped). Peak host memory is the store plus one chunk of one tensor. ``config`` is resolved by
    ``config.resolve_config`` (default: env MEGATRAIN_CONFIG; MEGATRAIN_<KEY> env vars override keys). ``dp``: the
    data-parallel ranks (hf_megatrain/parallel/); "auto": those of a multi-process launch. ``show_progress``: a bar
    of the bytes loaded, as transformers shows its own (on a terminal, unless transformers' progress bars are off),
    by one process of each node (the one that fills the node's store)."""
    from accelerate import init_empty_weights

    config = resolve_config(config)
    path = model_id_or_path
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(model_id_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"],
                                 revision=hf_kwargs.get("revision"), token=hf_kwargs.get("token"))
    model_keys = ("attn_implementation", "trust_remote_code")
    cfg = transformers.AutoConfig.from_pretrained(path, **{k: v for k, v in hf_kwargs.items()
                                                           if k not in ("dtype", "torch_dtype", "attn_implementation")})
    with init_empty_weights(include_buffers=False):
        model = causal_lm_skeleton(cfg, **{k: v for k, v in hf_kwargs.items() if k in model_keys})
    model.tie_weights()  # accelerate's meta init skips the tying the constructor would do
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    materialize_resident(model, config.layers_path)
    mapping = conversion_mapping(model)  # from the HF skeleton, before its layers become proxies
    if dp == "auto":
        dp = launched_data_parallel()
    engine = MegaTrainEngine(model, config, device=device, decay_names=decay_names, dp=dp)
    unused = load_weights(engine, path, prefix=ckpt.WEIGHTS_PREFIX, mapping=mapping,
                          show_progress=show_progress and engine.ranks.is_node_leader)
    if unused:
        logger.warning("hf_megatrain: %d checkpoint tensors not used by the model, e.g. %s", len(unused), unused[:5])
    return engine
