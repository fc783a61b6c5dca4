"""How the engine gets lm_head's input: from the stack's owner (a causal LM), or from a multimodal model's own forward.

A causal LM's forward is ``lm_head(decoder(input_ids))``: the engine runs the module that owns the layer stack (e.g.
``LlamaModel``) and computes the loss from its last hidden state (``StackOwnerRun``).

A causal LM whose forward does more between the decoder and the loss than hf_megatrain reproduces itself -- a head
transform before the projection (ModernBERT-decoder), an MoE aux loss through a function of its own (Doge) -- runs
its own forward the same way (``head_config.own_forward_reason`` says why; the choice is logged).

A multimodal ``...ForConditionalGeneration`` (Gemma 3, Qwen2/2.5/3-VL, Mistral 3, LLaVA, Idefics 3...) does more
before its language model: the vision / audio towers and the projector turn ``pixel_values`` into embeddings that are
scattered over the image placeholder tokens, and the model builds its own masks (Gemma 3's bidirectional attention
over image tokens from ``token_type_ids``) and positions (Qwen-VL's 3-D M-RoPE from ``image_grid_thw``). None of it
may be skipped or re-implemented without changing what is trained, so ``ModelForwardRun`` runs the model's *own*
forward, whose decoder layers are the streamed proxies and whose towers and projector are resident parts (trainable
or frozen as their ``requires_grad`` says, gradients by plain autograd), and takes the tensor the forward hands to
``lm_head``:

- ``lm_head`` is swapped, for the call, for a function that records its input and returns an empty ``[B, T, 0]``
  tensor, so the ``[B, T, vocab]`` logits are never built (the chunked loss computes them piecewise, as for every
  causal LM);
- the model's ``loss_function`` is swapped for one returning an exact 0, so whatever the forward adds to the loss
  besides the causal-LM cross-entropy (a MoE router aux loss computed from the recorded router logits) comes back as
  the forward's ``loss`` and is added to the engine's cross-entropy (``x + 0.0 == x`` exactly when there is none).

Both swaps are checked on every call: ``lm_head`` called exactly once, on a ``[B, T, H]`` input whose ``[B, T]``
are the labels', and ``loss_function`` called when labels are given; anything else raises naming the model.
Head extras (soft-capping, logit scaling) are applied where the model's forward applies them: ``applied_extras``
reads them off the forwards that run after ``lm_head`` (Gemma 3's multimodal forward applies no soft-cap even where
its text config sets one; Gemma 4's does).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .head_config import HEAD_ALIASES, own_forward_reason, own_loss_form
from .layers import LayerStack

logger = logging.getLogger(__name__)
Run = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (the one whose forward computes the loss), else ``model``."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def _forward_source(module: nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _head_owner(model: nn.Module, head: nn.Module) -> nn.Module | None:
    for mod in model.modules():
        if any(child is head for child in mod.children()):
            return mod
    return None


def applied_extras(model: nn.Module) -> set[str]:
    """The head extras (``head_config.HEAD_ALIASES`` keys) the forwards that run after ``lm_head`` name: the
    model's and the module owning ``lm_head`` (Llama 4's inner ``Llama4ForCausalLM``). Code outside transformers
    cannot be read and is taken to apply them all, as for a causal LM."""
    base = base_model_of(model)
    head = base.get_output_embeddings()
    owner = _head_owner(base, head)
    sources = [_forward_source(base)] + ([_forward_source(owner)] if owner is not None and owner is not base else [])
    if not all(sources):
        return set(HEAD_ALIASES)
    text = "\n".join(sources)
    return {extra for extra, names in HEAD_ALIASES.items() if any(n in text for n in names)}


class StackOwnerRun:
    """A causal LM: the module that owns the layer stack runs embeddings -> layers -> final norm."""

    runs_model = False

    def __init__(self, stack: LayerStack) -> None:
        self.stack = stack

    def __call__(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 labels: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.stack.parent(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        return (out[0] if isinstance(out, tuple) else out.last_hidden_state), None  # [B, T, H]


class ModelForwardRun:
    """A multimodal model: its own forward, up to lm_head's input (see the module docstring)."""

    runs_model = True

    def __init__(self, model: nn.Module) -> None:
        self.model = base_model_of(model)
        self.name = type(self.model).__name__
        # A forward that computes its own loss in a form hf_megatrain reproduces (head_config.OWN_LOSS_FORMS:
        # CPM-Ant's unshifted mean) would compute it on the empty logits: it runs without labels, the head applies it.
        self.own_loss = own_loss_form(self.model) is not None

    @contextmanager
    def _swapped(self, seen: list[torch.Tensor], losses: list[int]) -> Iterator[None]:
        model, head = self.model, self.model.get_output_embeddings()

        def record_input(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            seen.append(hidden)
            return hidden.new_empty(*hidden.shape[:-1], 0)

        def no_cross_entropy(*args: Any, **kwargs: Any) -> torch.Tensor:
            losses.append(1)
            logits = kwargs.get("logits", args[0] if args else None)
            dev = logits.device if isinstance(logits, torch.Tensor) else None
            return torch.zeros((), dtype=torch.float32, device=dev)

        had_loss = "_loss_function" in vars(model)
        old_loss = vars(model).get("_loss_function")
        head.forward = record_input  # (an instance attribute: nn.Module.__call__ looks it up first)
        model.loss_function = no_cross_entropy  # (transformers' setter: an instance attribute too)
        try:
            yield
        finally:
            del head.forward
            if had_loss:
                model.loss_function = old_loss
            else:
                del model._loss_function

    def __call__(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 labels: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        seen: list[torch.Tensor] = []
        losses: list[int] = []
        with self._swapped(seen, losses):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             labels=None if self.own_loss else labels, use_cache=False, **kwargs)
        if len(seen) != 1:
            raise RuntimeError(
                f"hf_megatrain: {self.name}.forward called its output embeddings (lm_head) {len(seen)} times; "
                "hf_megatrain computes the loss from the one lm_head input of a forward, so this model cannot be "
                "trained exactly here. Train it with plain transformers.")
        hidden = seen[0]
        ref = labels if labels is not None else input_ids
        if hidden.dim() != 3 or (ref is not None and tuple(hidden.shape[:2]) != tuple(ref.shape[:2])):
            raise RuntimeError(
                f"hf_megatrain: {self.name}.forward gave lm_head an input of shape {tuple(hidden.shape)}, not "
                f"[batch, seq, hidden] matching the {'labels' if labels is not None else 'input_ids'} "
                f"{tuple(ref.shape) if ref is not None else ''}: hf_megatrain's shifted causal-LM loss would pair "
                "hidden states with the wrong labels. Pass labels aligned with the sequence the model builds "
                "(one per position), or train this model with plain transformers.")
        if labels is not None and not losses and not self.own_loss:
            raise RuntimeError(
                f"hf_megatrain: {self.name}.forward computed no causal-LM loss through self.loss_function for the "
                "labels given, so the loss hf_megatrain computes would not be this model's. Train it with plain "
                "transformers.")
        if labels is None or self.own_loss:
            return hidden, None
        return hidden, out.loss if hasattr(out, "loss") else out[0]  # (a tuple output starts with the loss)


def decoder_run(model: nn.Module, stack: LayerStack) -> StackOwnerRun | ModelForwardRun:
    """How the engine runs ``model`` up to lm_head's input (see the module docstring)."""
    why = own_forward_reason(base_model_of(model), stack.parent)  # (a multimodal model, a head transform...)
    if why is not None:
        logger.info("hf_megatrain: %s runs its own forward up to lm_head's input: %s", type(model).__name__, why)
    return ModelForwardRun(model) if why is not None else StackOwnerRun(stack)
