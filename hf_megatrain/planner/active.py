"""Parameters one token runs through: a mixture-of-experts layer routes each token to ``top_k`` of its
``num_experts`` routed experts, so only that fraction of the expert weights does work for it.

The FLOPs of a training step (``long_context.flops_per_token``: 6 x N) are those of the *active* parameters: for
DeepSeek-V3 ~37B of 671B, for gpt-oss-120b ~5.7B of 117B (both embeddings counted). Counting all of them
overstates an MoE's work 10-30x, and with it every time / MFU figure derived from it.

Found from the module tree, not from per-family config keys, so that dense layers among MoE ones (DeepSeek's
``first_k_dense_replace``, Jamba's / Llama 4's MoE layer period, ``mlp_only_layers``), shared experts (a module of
their own: ``shared_expert(s)``, always active) and routers (every token goes through them) need no rule each:

- a routed-expert block is a submodule named ``experts`` (transformers' fused ``*Experts`` with
  ``[num_experts, ...]`` weights, or a ``ModuleList`` of per-expert MLPs in older / remote code);
- its expert count: the block's ``num_experts`` (or kin), a ``ModuleList``'s length, the router's, or the
  config's; top-k: the MoE block's ``top_k`` (or kin), its router's (``gate`` / ``router``), a ``config`` they
  hold (Gemma 4's router reads ``config.top_k_experts``), else the model config's (DBRX's ``ffn_config``);
- a block whose count or top-k cannot be found is counted whole (the old, conservative answer), never guessed.

Works on the meta device (sizes only) and on the engine's layer templates (``from_engine``).
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

__all__ = ["EXPERTS", "routed_inactive_numel", "expert_blocks"]

EXPERTS = "experts"  # the submodule name transformers gives routed experts in every MoE family (shared: other names)
_NUM_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("top_k", "num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_top_k", "moe_topk",
          "moe_k", "top_k_experts")


def _int(objs: Iterable[Any], names: tuple[str, ...]) -> int | None:
    """The first positive int attribute among ``names`` on any of ``objs`` (in order)."""
    for o in objs:
        if o is None:
            continue
        for name in names:
            try:
                v = getattr(o, name, None)
            except Exception:  # noqa: BLE001 -- heterogeneous configs raise on a per-layer attribute read globally
                v = None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _configs(config: Any) -> list[Any]:
    """The model config, its text config (multimodal) and DBRX-style nested ``ffn_config``: where top-k lives."""
    out = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        out.append(text)
    out += [getattr(c, "ffn_config", None) for c in list(out)]
    return [c for c in out if c is not None]


def expert_blocks(module: nn.Module, config: Any = None) -> list[tuple[str, int, int | None, int | None]]:
    """``(name, numel, num_experts, top_k)`` of each routed-expert block in ``module`` (outermost ones only;
    parameters shared with an earlier block counted once). ``num_experts`` / ``top_k`` None: not found."""
    mods = dict(module.named_modules())
    cfgs = _configs(config) if config is not None else []
    seen: set[int] = set()
    out: list[tuple[str, int, int | None, int | None]] = []
    taken: list[str] = []
    for name, mod in mods.items():
        if name.rsplit(".", 1)[-1] != EXPERTS or any(name.startswith(t + ".") for t in taken):
            continue
        params = [p for p in mod.parameters() if id(p) not in seen]
        if not params:
            continue
        taken.append(name)
        seen.update(id(p) for p in params)
        parent = mods.get(name.rsplit(".", 1)[0], module) if "." in name else module
        siblings = [c for n, c in parent.named_children() if c is not mod]
        held = [getattr(o, "config", None) for o in [parent, *siblings]]
        n_exp = _int([mod], _NUM_EXPERTS) or (len(mod) if isinstance(mod, nn.ModuleList) else None) \
            or _int(siblings + held + cfgs, _NUM_EXPERTS)
        top_k = _int([parent, *siblings] + held + cfgs, _TOP_K)
        out.append((name, sum(p.numel() for p in params), n_exp, top_k))
    return out


def routed_inactive_numel(modules: Iterable[nn.Module], config: Any = None) -> int:
    """Parameters of ``modules`` a token does not run through: ``(1 - top_k / num_experts)`` of every routed-expert
    block's (rounded down per block). 0 for a dense model."""
    total = 0
    for mod in modules:
        for _, numel, n_exp, top_k in expert_blocks(mod, config):
            if n_exp and top_k:
                total += numel - numel * min(top_k, n_exp) // n_exp
    return total
