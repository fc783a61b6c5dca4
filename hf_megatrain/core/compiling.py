"""How hf_megatrain uses ``torch.compile``: shapes that vary without recompiling, recompile limits that cannot
silently turn compilation off, and what its two users (layer templates on the main thread, the host AdamW kernel on
an optimizer worker) need to know about each other.

**Dynamic token dimensions.** Fine-tuning data has a different sequence length in every batch (padded to the
batch's longest, or packed rows of varying total), and a micro-batched visit ends with a smaller chunk. Compiled
with ``dynamic=False`` every new (batch, length) is a new graph -- measured on an H100 at 7B width, 16 graphs and
first steps of 9.4 / 7.2 / 6.7 / 3.8 s against a 1.1 s steady step -- and after ``recompile_limit`` (8) graphs
dynamo quietly runs the layer eagerly. So before each compiled call the batch and token dimensions of the *inputs*
are marked dynamic (``mark_token_dims``): the first call compiles one graph symbolic in them, and every later length
reuses it. Parameter shapes stay static (``force_parameter_static_shapes``, and nothing of them is marked), so the
kernels over the hidden dimension are the same as a static compile's: only the token count is a runtime value.
``maybe_mark_dynamic`` (not ``mark_dynamic``) lets dynamo specialise a marked dim where the code needs a constant
(a size-1 batch, a dim that only coincides with the length) instead of raising. ``dynamic=None`` keeps dynamo's
automatic dynamic shapes as the backstop: an input dim this marking misses becomes dynamic on its second value,
one extra graph, never one per length.

**Alignment guards.** On CUDA, inductor lowers SDPA with an attention bias by asking whether the bias's strides
are multiples of 8 elements (``is_aligned_realized_tensor``), and answers with a *guard*: for a padded batch's
``[batch, 1, tokens, tokens]`` mask that is ``tokens % 8 == 0``, so the first width of the other class compiles the
layer again (measured on an H100: a 16.9 s step among 1.9 s ones at 14B width). ``compile_fn`` installs
``_no_alignment_guard`` once: the same question answered only where the sizes decide it statically (static shapes:
the same answer as before); a symbolic one takes inductor's other branch, which copies the bias into an aligned
buffer -- the same values, one bias-sized copy per attention call, and one graph for every width.

Still one graph each, once: a batch of one row (dynamo specialises sizes 0 and 1; ``maybe_mark_dynamic`` allows it
rather than raising) and a batch without padding (HF then passes no mask at all: another graph input structure).

``DYNAMIC_SHAPES = False`` (a module constant, not a user setting: mechanism code reads no environment) restores the
old one-graph-per-shape compile (``dynamic=False``, nothing marked), for tests and A/B timing only.

**Recompile limits.** ``call_compiled`` runs a compiled call with ``fail_on_recompile_limit_hit``: when dynamo would
give up on a function (more than ``torch._dynamo.config.recompile_limit`` graphs), the call raises before running
anything; it then runs eagerly with a warning that names the limit, and later calls still use the graphs that exist.

**Concurrent tracing.** While dynamo compiles a function it traces it with FX, and "FX is tracing" is a
process-wide flag, not a per-thread one: a compiled function *called* on another thread during that window refuses
to run ("Detected that you are using FX to symbolically trace a dynamo-optimized function"). With the optimizer
overlapping the forward, a layer that compiles (its first call, a new shape at evaluation) can meet a host AdamW
call, and the reverse. The refusal happens before the function does anything, so the caller runs the same math
another way for that one call (the layer eagerly, the update with the fused kernel) and keeps the compiled function
for the next.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

NESTED_FX = "FX to symbolically trace a dynamo-optimized function"
DYNAMIC_SHAPES = True  # token dims compiled symbolically; False: one graph per shape (tests, A/B timing)


def dynamic_shapes() -> bool:
    return DYNAMIC_SHAPES


def _no_alignment_guard() -> None:
    """Make inductor's SDPA-bias alignment check (``torch._inductor.ir.is_aligned_realized_tensor``) decide from
    what is statically known instead of guarding on symbolic sizes (see the module docstring). Idempotent; a torch
    without the function is left alone."""
    try:
        from torch._inductor import ir
        from torch._inductor.virtualized import V
    except Exception:  # noqa: BLE001 - no inductor: nothing to patch
        return
    original = getattr(ir, "is_aligned_realized_tensor", None)
    if original is None or getattr(original, "_megatrain_no_guard", False):
        return

    def is_aligned_realized_tensor(x: Any, alignment: int) -> bool:
        sizevars = V.graph.sizevars
        sizevars.guard_or_false = sizevars.statically_known_true  # (instance attribute: this call only)
        try:
            return original(x, alignment)
        finally:
            del sizevars.guard_or_false

    is_aligned_realized_tensor._megatrain_no_guard = True  # type: ignore[attr-defined]
    is_aligned_realized_tensor._megatrain_original = original  # type: ignore[attr-defined]
    ir.is_aligned_realized_tensor = is_aligned_realized_tensor


def compile_fn(fn: Callable) -> Callable:
    """``torch.compile(fn)`` as this module describes. Each call site gets its own recompile budget where torch
    offers it (``isolate_recompiles``, torch >= 2.13): the layer templates of one model share one code object
    (``LayerTemplate._functional``), and one kind's graphs should not count against another's limit."""
    kwargs: dict[str, Any] = {"dynamic": None if dynamic_shapes() else False}
    if dynamic_shapes():
        _no_alignment_guard()
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        kwargs["isolate_recompiles"] = True
    return torch.compile(fn, **kwargs)


def mark_token_dims(batch: int, tokens: int, tree: Any) -> None:
    """Mark dim 0 of every input tensor in ``tree`` that has ``batch`` rows, and every dim equal to ``tokens``, as
    dynamic for the next compiled call. The hidden state is [batch, tokens, hidden]; what travels beside it (rotary
    cos/sin [batch or 1, tokens, head_dim], a [batch, 1, tokens, tokens] mask, [batch, tokens] position ids, a loss
    chunk's [tokens, vocab] logits) carries the same two sizes, and they must all be symbolic together or the first
    broadcast against a static one specialises the length again. Sizes 0 and 1 are left alone (dynamo always
    specialises them)."""
    if not dynamic_shapes():
        return
    for x in pytree.tree_leaves(tree):
        if not isinstance(x, torch.Tensor) or isinstance(x, torch.nn.Parameter):
            continue
        for d, n in enumerate(x.shape):
            if n > 1 and (n == tokens or (d == 0 and n == batch)):
                torch._dynamo.maybe_mark_dynamic(x, d)


def _limit_hit(error: BaseException) -> bool:
    from torch._dynamo.exc import FailOnRecompileLimitHit

    return isinstance(error, FailOnRecompileLimitHit)


class CompiledCall:
    """A compiled function that never falls back to eager in silence. ``__call__`` raises what the compiled call
    raised, except a hit recompile limit: that call runs ``eager`` instead, with one warning per ``CompiledCall``."""

    def __init__(self, fn: Callable, eager: Callable, name: str, warn: Callable[[str], None]) -> None:
        self.compiled = compile_fn(fn)
        self.eager, self.name, self.warn = eager, name, warn
        self.limit_hits = 0

    def __call__(self, *args: Any) -> Any:
        import torch._dynamo.config as dynamo_config

        if dynamo_config.suppress_errors:  # (the two flags refuse each other; suppress_errors then decides)
            return self.compiled(*args)
        try:
            with dynamo_config.patch(fail_on_recompile_limit_hit=True):
                return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - only the limit is handled here
            if not _limit_hit(e):
                raise
        self.limit_hits += 1
        if self.limit_hits == 1:
            self.warn(f"hf_megatrain: {self.name} hit torch._dynamo.config.recompile_limit "
                      f"({dynamo_config.recompile_limit}): calls with shapes it has no graph for run eagerly (same "
                      "math, slower); the graphs it has are still used. Raise the limit if this model needs more "
                      f"graphs (TORCH_LOGS=recompiles says why each one was made).")
        return self.eager(*args)


def is_concurrent_trace(error: BaseException) -> bool:
    """``error`` is dynamo refusing a call because another thread is compiling (transient: retry later)."""
    return isinstance(error, RuntimeError) and NESTED_FX in str(error)
