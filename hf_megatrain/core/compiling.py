"""What the two users of ``torch.compile`` here (layer templates on the main thread, the host AdamW kernel on an
optimizer worker) need to know about each other.

While dynamo compiles a function it traces it with FX, and "FX is tracing" is a process-wide flag, not a per-thread
one: a compiled function *called* on another thread during that window refuses to run ("Detected that you are using
FX to symbolically trace a dynamo-optimized function"). With the optimizer overlapping the forward, a layer that
compiles (its first call, a new shape at evaluation) can meet a host AdamW call, and the reverse. The refusal
happens before the function does anything, so the caller runs the same math another way for that one call (the
layer eagerly, the update with the fused kernel) and keeps the compiled function for the next.
"""

from __future__ import annotations

NESTED_FX = "FX to symbolically trace a dynamo-optimized function"


def is_concurrent_trace(error: BaseException) -> bool:
    """``error`` is dynamo refusing a call because another thread is compiling (transient: retry later)."""
    return isinstance(error, RuntimeError) and NESTED_FX in str(error)
