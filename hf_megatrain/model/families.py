"""What a family's ``*ForCausalLM.forward`` does after the decoder, read off the model (no per-family table).

hf_megatrain replaces the HF head with a chunked loss over streamed layers, so the head-side differences
between families must be applied here, exactly as HF applies them:

- final logit soft-capping (Gemma 2/3: ``config.final_logit_softcapping``), passed to the chunked loss;
- logit scaling (Cohere ``logit_scale`` multiplies, Granite ``logits_scaling`` divides), applied to the hidden
  state before the bias-free lm_head (``lm_head(h) * s == lm_head(h * s)``);
- the mixture-of-experts router auxiliary loss: when ``output_router_logits`` is set and labels are given, HF
  adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``.

Each extra is looked up under all the names families give it (``head_config.HEAD_ALIASES``); a config attribute
that looks like a head extra but is in no table is refused by ``check_supported``.

Router logits: HF records them with forward hooks on the router modules (``_can_record_outputs``). Our layers
run as stateless templates inside one autograd Function per layer, so ``RouterTap`` hooks the *templates'*
router modules instead. In the forward it collects each layer's logits, which the layer's Function returns as
extra outputs (engine/proxy.py); the aux loss on them backpropagates into that Function, whose backward recomputes
the layer and back-propagates ``[hidden, router_logits]`` together. Same function of the same logits,
differentiated by autograd: the gradient is exact, router weights included.

``check_supported`` rejects models whose forward is not "decoder -> lm_head" (encoder-only MLM heads,
encoder-decoders) before the engine converts anything.
"""

from __future__ import annotations

import inspect
import logging
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .head_config import (NOT_CAUSAL_LM, check_head_extras, embedding_owner, head_module_params, head_transforms,
                          head_value, is_composite, other_layer_lists, own_loss_form, text_config_of)
from .layers import LayerStack
from .loss import TokenStats
from .loss_impl import choose, head_loss
from .multimodal import applied_extras, base_model_of, decoder_run

logger = logging.getLogger(__name__)


# -- supported models -----------------------------------------------------------------------------------------------
def _check_standard_loss(model: nn.Module, hint: str) -> None:
    """hf_megatrain computes transformers' shifted causal-LM loss (``ForCausalLMLoss``). A transformers class whose
    forward computes its loss some other way (no ``self.loss_function``: unshifted targets, its own prediction
    layer or adaptive softmax -- XLM, XLNet) would train on a different objective without any error: refuse, except
    the forms hf_megatrain reproduces (``head_config.OWN_LOSS_FORMS``: TrOCR's unshifted mean).
    Classes from outside transformers (remote code, user models) cannot be read this way and are taken as they are."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # (PEFT)
    cls = type(base)
    if not cls.__module__.startswith("transformers."):
        return
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return
    if "self.loss_function(" not in source and own_loss_form(base) is None:  # (TrOCR's: head_config.OWN_LOSS_FORMS)
        why = NOT_CAUSAL_LM.get(cls.__name__)
        raise ValueError(f"{cls.__name__} computes its training loss in its own forward, not with transformers' "
                         "causal-LM loss that hf_megatrain reproduces (shifted labels, lm_head over the final hidden "
                         "state), so training it here would optimise a different objective"
                         f"{': ' + why if why else ''}. {hint}")


def whole_stack_function(stack: LayerStack) -> str | None:
    """The ``torch.autograd.Function`` that the stack owner's forward applies to the layer list as a whole, if any
    (Reformer's ``_ReversibleFunction.apply(hidden_states, self.layers, ...)``: reversible layers, whose backward
    recomputes each layer's input from its output over the whole stack). Streaming runs each layer in its own
    Function, so it cannot reproduce that one."""
    import re

    try:
        source = inspect.getsource(type(stack.parent).forward)
    except (OSError, TypeError):
        return None
    attr = stack.path.rpartition(".")[2]
    for name, obj in vars(sys.modules.get(type(stack.parent).__module__) or object()).items():
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function) and \
                re.search(rf"\b{re.escape(name)}\.apply\([^)]*\bself\.{re.escape(attr)}\b", source):
            return name
    return None


def check_supported(model: nn.Module, stack: LayerStack) -> None:
    """Raise a clear error unless ``model`` is a decoder-only LM whose forward is ``stack.parent`` -> lm_head."""
    name = type(model).__name__
    cfg = getattr(model, "config", None)
    hint = ("hf_megatrain trains decoder-only causal LMs (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, Mixtral, "
            "Qwen3-MoE, gpt-oss, ... loaded with AutoModelForCausalLM).")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model, which hf_megatrain does not support. {hint}")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"{name} has no output embeddings (lm_head) to train a language-model loss on. {hint}")
    whole = whole_stack_function(stack)
    if whole is not None:
        raise ValueError(
            f"{name} is not supported: {type(stack.parent).__name__}.forward runs its whole layer stack "
            f"({stack.path}) inside one autograd Function ({whole}: reversible layers, whose backward recomputes each "
            "layer's input from its output across the stack), so hf_megatrain's per-layer streaming (one Function "
            "per layer) cannot reproduce it. Train it with plain transformers.")
    # A causal LM: the engine runs the module that owns the layer stack, then the output embeddings. Any trainable
    # weight outside both (BERT's MLM transform, its embeddings outside the encoder, a value head) would be skipped.
    # A multimodal model runs its own forward up to lm_head (model/multimodal.py): its towers are in the path; so
    # does a model with a head transform before the projection (head_config.head_transforms: ModernBERT-decoder),
    # and one whose stack owner takes hidden states from a module that embeds the ids (head_config.embedding_owner:
    # CPM-Ant) -- unless it also has a head transform: an encoder's embeddings and MLM prediction head (BERT family).
    transforms = head_transforms(base_model_of(model), stack.parent)
    owner = None if transforms else embedding_owner(base_model_of(model), stack.parent)
    inside = {id(p) for p in stack.parent.parameters()} | {id(p) for p in head.parameters()} | \
        {id(p) for m in transforms for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside and not is_composite(base_model_of(model)):
        # (before the embedding owner's parameters count as inside: a second layer stack there -- HRM's H module
        # beside the streamed L module -- is a multi-stack model, not embeddings)
        stacks = other_layer_lists(model, stack.layers, {id(p) for p in model.parameters() if id(p) not in inside})
        if stacks:
            raise ValueError(
                f"{name} is not supported: its forward runs {len(stacks) + 1} layer stacks ({stack.path}, "
                f"{', '.join(stacks[:4])}{', ...' if len(stacks) > 4 else ''}): a hierarchical / multi-stack model, "
                "not the one decoder-layer stack "
                "(embeddings -> layers -> norm -> lm_head) that hf_megatrain streams. (If the model has one decoder "
                "stack and hf_megatrain picked the wrong list, name it: MegaTrainConfig(layers_path=...).)")
        embedded = {id(p) for p in (owner.parameters() if owner is not None else ())}
        outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside | embedded]
    if outside and not is_composite(base_model_of(model)):
        shown = ", ".join(outside[:4]) + (", ..." if len(outside) > 4 else "")
        decoder = stack.path.rpartition(".")[0] or "model"
        raise ValueError(
            f"{name} is not supported: hf_megatrain computes the loss as lm_head({decoder}(input_ids)), but "
            f"{len(outside)} trainable parameter(s) sit outside that path ({shown}); this is not a plain "
            f"decoder-only causal LM (encoder-only / masked-LM head?). {hint}")
    check_head_extras(model)
    _check_standard_loss(model, hint)  # last: the structural refusals above say more when they apply


# Layer modules whose forward mixes the batch's tokens across rows, so a visit run on some rows of the batch
# (``micro_batch_size``) computes other values than the whole batch does: Doge's product-key MoE views its router
# logits ``[batch, seq, 2 * keys]`` as ``[2, batch * seq, keys]`` (transformers' DogeCDMoE), pairing one token's
# halves with other tokens'. Plain transformers always runs the whole batch, so the split would train another model.
# Gemma 3n's decoder layers carry the hidden state as ``[altup_inputs, batch, seq, hidden]`` (AltUp): its leading
# dim is not the batch, so the split cannot cut rows there either.
ROW_MIXING_MODULES = {"DogeCDMoE": "its router reshapes the logits of all the batch's tokens together "
                                   "(router_gate(h).view(2, batch * seq_len, -1))",
                      "Gemma3nTextAltUp": "carries the hidden state as [altup_inputs, batch, seq, hidden] (AltUp), "
                                          "whose leading dim is not the batch the split cuts"}


def check_row_split(layers: nn.Module, micro_batch_size: int) -> None:
    """Refuse ``micro_batch_size`` > 0 when a decoder layer mixes rows of the batch (``ROW_MIXING_MODULES``)."""
    if micro_batch_size <= 0:
        return
    for module in layers.modules():
        why = ROW_MIXING_MODULES.get(type(module).__name__)
        if why is not None:
            raise ValueError(f"micro_batch_size={micro_batch_size} is not supported for this model: "
                             f"{type(module).__name__} {why}, so a layer run on part of the batch computes other "
                             "values than plain transformers on the whole batch. Set micro_batch_size=0 (lower "
                             "per_device_train_batch_size and raise gradient_accumulation_steps instead).")


# -- router logits ----------------------------------------------------------------------------------------------------
def _recorder_specs(base: nn.Module) -> list[tuple[type | None, str | None, str | None, int]]:
    """(class, class-name suffix, layer name, output index) of every module HF records ``router_logits`` from."""
    specs = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    if specs is None:
        return []
    out = []
    for s in specs if isinstance(specs, list) else [specs]:
        if isinstance(s, type):
            out.append((s, None, None, 1))  # HF's default index for non-hidden-state keys
        elif isinstance(s, str):
            out.append((None, s, None, 1))
        else:  # OutputRecorder
            out.append((s.target_class, s.class_name, s.layer_name, s.index))
    return out


class RouterTap:
    """Collects router logits from the layer templates' router modules while ``start``ed (see module docstring)."""

    def __init__(self, templates: list[Any], specs: list[tuple[type | None, str | None, str | None, int]]) -> None:
        self.active = False  # read by the executor: layer Functions return side outputs only when active
        self._collecting: dict[Any, list[torch.Tensor]] | None = None
        self._recorded: list[torch.Tensor] = []
        self.num_sites = 0
        for t, tmpl in enumerate(templates):
            for mname, mod in tmpl.module.named_modules():
                for cls, cls_name, layer_name, index in specs:
                    hit = (cls is not None and isinstance(mod, cls)) or (
                        cls_name is not None and type(mod).__name__.endswith(cls_name))
                    if hit and (layer_name is None or f".{layer_name.strip('.')}." in f".{mname}."):
                        mod.register_forward_hook(self._hook((t, mname), index))
                        tmpl.compiled = None  # the hook's side effect must run: keep this template eager
                        self.num_sites += 1
                        break

    def _hook(self, key: Any, index: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._collecting is not None:
                self._collecting.setdefault(key, []).append(output[index] if isinstance(output, tuple) else output)
        return hook

    # Executor side: bracket one layer visit (forward or recompute); chunks of one visit are concatenated, so
    # each site yields [batch * seq, num_experts] rows in batch order, like one unsplit call.
    def start(self) -> None:
        self._collecting = {}

    def stop(self) -> list[torch.Tensor]:
        got, self._collecting = self._collecting or {}, None
        return [v[0] if len(v) == 1 else torch.cat(v) for v in got.values()]

    def record(self, tensors: Any) -> None:
        self._recorded.extend(tensors)

    @contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        """Activate for one model forward; yields the list that fills with every layer's logits in layer order."""
        self._recorded = out = []
        self.active = True
        try:
            yield out
        finally:
            self.active = False
            self._recorded = []


def load_balancing_loss(gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, as transformers' ``load_balancing_loss_func`` (fallback only)."""
    dev = gate_logits[0].device
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    rows: Any = 0.0
    mask = attention_mask.reshape(-1).to(dev, torch.float32) if attention_mask is not None else None
    for g in gate_logits:
        w = torch.softmax(g.to(dev), dim=-1)
        _, sel = torch.topk(w, top_k, dim=-1)
        if mask is None:
            tokens = tokens + torch.bincount(sel.reshape(-1), minlength=num_experts).float()
            probs = probs + w.float().sum(dim=0)
            rows = rows + w.shape[0]
        else:
            tokens = tokens + torch.zeros_like(tokens).scatter_add_(0, sel.reshape(-1), mask.repeat_interleave(top_k))
            probs = probs + (w.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return torch.sum((tokens / rows) * (probs / rows).unsqueeze(0)) * num_experts


class RouterAux:
    """The MoE aux-loss term of an HF ``*MoeForCausalLM``: coefficient, expert counts, loss function, tap."""

    def __init__(self, model: nn.Module, tap: RouterTap, coef: float | None) -> None:
        self.model, self.tap = model, tap
        self.coef = coef  # None: only the tap, for a model forward that computes its aux loss itself
        self.num_experts = int(getattr(model, "num_experts", 0))
        self.top_k = int(getattr(model, "num_experts_per_tok", 0))
        # The family's own function where it has one (exact semantics), else the shared formula.
        self.fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", load_balancing_loss)

    @staticmethod
    def detect(model: nn.Module, stack: LayerStack, executor: Any) -> RouterAux | None:
        """The aux term of ``model`` (None for dense models); installs its tap on the executor's templates."""
        coef = head_value(model, "router_coef")  # router_aux_loss_coef or an alias (head_config.HEAD_ALIASES)
        if coef is None or not all(hasattr(model, a) for a in ("num_experts", "num_experts_per_tok")):
            return None
        specs = _recorder_specs(stack.parent)
        tap = RouterTap(executor.templates, specs) if specs else None
        if tap is None or tap.num_sites == 0:
            if getattr(getattr(model, "config", None), "output_router_logits", False):
                raise NotImplementedError(
                    f"{type(model).__name__} asks for the MoE router aux loss (config.output_router_logits=True) "
                    "but hf_megatrain found no router module to record logits from "
                    f"({type(stack.parent).__name__}._can_record_outputs has no usable 'router_logits' entry). "
                    "Set config.output_router_logits=False to train without the aux loss.")
            return None
        executor.tap = tap
        return RouterAux(model, tap, coef[1])

    @staticmethod
    def detect_tap(model: nn.Module, stack: LayerStack, executor: Any) -> RouterAux | None:
        """A multimodal model whose own forward runs (model/multimodal.py) computes its aux loss itself, from the
        router logits its decoder returns: only the tap that records them is needed (None where no router)."""
        specs = _recorder_specs(stack.parent)
        tap = RouterTap(executor.templates, specs) if specs else None
        if tap is None or tap.num_sites == 0:
            return None
        executor.tap = tap
        return RouterAux(model, tap, None)

    def wanted(self, kwargs: dict[str, Any]) -> bool:
        flag = kwargs.get("output_router_logits")
        if flag is not None:
            return bool(flag)
        cfg = getattr(self.model, "config", None)
        # (a multimodal config may set it on itself or on its text config: either asks for the logits)
        return any(bool(getattr(c, "output_router_logits", False)) for c in (cfg, text_config_of(cfg)) if c is not None)

    def loss(self, logits: list[torch.Tensor], attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        return self.fn(tuple(logits), self.num_experts, self.top_k, attention_mask) if logits else None


# -- the head ---------------------------------------------------------------------------------------------------------
class ModelHead:
    """Logits / loss of ``model`` from the decoder's last hidden state, with the family's extras."""

    def __init__(self, model: nn.Module, stack: LayerStack, executor: Any, loss_impl: str = "chunked",
                 device: torch.device | None = None, compute_dtype: torch.dtype = torch.float32) -> None:
        # How a forward reaches lm_head's input: the stack's owner, or a multimodal model's own forward
        # (model/multimodal.py), whose towers run before the decoder.
        self.run = decoder_run(model, stack)
        # Each extra under any of its config names (head_config.HEAD_ALIASES); check_supported has refused the
        # head-extra-like attributes that are in no table. A multimodal model's forward may ignore one its text
        # config sets (Gemma 3 applies no final soft-cap): only those its forward applies.
        applied = applied_extras(model) if self.run.runs_model else None

        def extra(name: str) -> tuple[str, float] | None:
            return head_value(model, name) if applied is None or name in applied else None

        softcap = extra("softcap")
        self.softcap = softcap[1] if softcap else None
        scale = 1.0
        mul, div = extra("scale_mul"), extra("scale_div")
        if mul is not None:  # Cohere logit_scale, Falcon-H1 lm_head_multiplier: logits * s
            scale *= mul[1]
        if div is not None:  # Granite logits_scaling: logits / s
            scale /= div[1]
        self.scale = scale
        self.router = RouterAux.detect_tap(model, stack, executor) if self.run.runs_model else \
            RouterAux.detect(model, stack, executor)
        # The loss implementation (model/loss_impl.py), chosen once for this head and device.
        head = model.get_output_embeddings()
        # A head whose forward applies parameters of its own (Dory's logit_scale): its forward per chunk, unfused.
        self.head_params = head_module_params(head)
        unfused = f"{type(head).__name__} applies {', '.join(self.head_params[:3])}" if self.head_params else None
        self.loss_impl, why = choose(loss_impl, device or torch.device("cpu"),
                                     bias=getattr(head, "bias", None) is not None, softcap=self.softcap,
                                     dtype=compute_dtype, unfused=unfused)
        self.loss_impl_reason = why
        # A forward's own loss form (TrOCR: unshifted labels, mean over this forward's tokens): head_config.
        self.unshifted = own_loss_form(base_model_of(model)) == "unshifted_mean"
        logger.info("hf_megatrain: head loss %s (%s)", self.loss_impl.value, why)

    def hook_model_forward(self, before: Callable[[], None]) -> None:
        """Call ``before`` ahead of every forward of a multimodal model (its towers run before the decoder, whose
        own pre-hook comes too late for them: the engine publishes the resident weights there)."""
        if self.run.runs_model:
            self.run.model.register_forward_pre_hook(lambda *_: before())

    @contextmanager
    def capture(self, kwargs: dict[str, Any]) -> Iterator[list[torch.Tensor] | None]:
        """Around the decoder forward: yields the per-layer router logits (None for dense / aux-free runs, and
        for a multimodal model, whose forward records them and adds its aux loss itself)."""
        if self.run.runs_model or self.router is None or not self.router.wanted(kwargs):
            yield None
            return
        with self.router.tap.capturing() as logits:
            yield logits

    def _scaled(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        if self.scale == 1.0:
            return hidden
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("logit scaling with a biased lm_head is not supported")
        return hidden * self.scale

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        z = head(self._scaled(hidden, head))
        return torch.tanh(z / self.softcap) * self.softcap if self.softcap else z

    def loss(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *, chunk_tokens: int,
             num_items_in_batch: torch.Tensor | int | None, router_logits: list[torch.Tensor] | None,
             attention_mask: torch.Tensor | None, compiled: bool = False,
             stats: TokenStats | None = None) -> torch.Tensor:
        head_fn = ((lambda h: self.logits(h, head)), [p for p in head.parameters() if p.requires_grad]) \
            if self.head_params else None  # (the head's forward with the extras: from the unscaled hidden state)
        loss = head_loss(self.loss_impl, hidden if head_fn else self._scaled(hidden, head), head.weight, labels,
                         bias=getattr(head, "bias", None),
                         num_items_in_batch=None if self.unshifted else num_items_in_batch,
                         chunk_tokens=chunk_tokens, softcap=self.softcap, compiled=compiled, stats=stats,
                         head_fn=head_fn, shift=not self.unshifted)
        if router_logits is not None and self.router is not None and self.router.coef is not None:
            aux = self.router.loss(router_logits, attention_mask)
            if aux is not None:
                loss = loss + self.router.coef * aux.to(loss.device)
        return loss
