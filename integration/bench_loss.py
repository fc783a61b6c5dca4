"""Head-loss implementations on the GPU: hf_megatrain's chunked loss (eager and ``torch.compile``d) vs Liger's fused
linear cross-entropy vs Apple's Cut Cross-Entropy (``loss_impl``), at a Qwen2.5-14B head (hidden 5120, vocabulary
152064) in bfloat16.

For each implementation and token count: the time of one forward + backward (median of ``--iters`` after
``--warmup``, CUDA events), the peak GPU memory it adds over its inputs (``max_memory_allocated``), and its
correctness against an fp32 reference (the chunked loss in fp32 with TF32 off: HF's own ops, chunked): relative
error of the loss and of the hidden / lm_head gradients. The bf16 chunked loss's own error is the yardstick.
Every run goes through ``model.loss_impl.head_loss``, i.e. exactly what the engine calls (shift, -100, the
``num_items_in_batch`` normalisation). An implementation that cannot run is recorded with the reason, not fatal.

    python integration/bench_loss.py                             # JSON to $OUT/bench_loss.json (or ./)
    python integration/bench_loss.py --tokens 8192,32768 --json integration/results/bench_loss/<date>_<commit>_bench_loss_<gpu>.json
    python integration/bench_loss.py --quick                     # small shapes: a smoke run (also on CPU)

Liger / CCE are not in the GPU image: carry their wheels (``integration/prepare_loss_wheels.sh``) and
``pip install --no-deps .carry/wheels/{liger_kernel,cut_cross_entropy}-*.whl`` there first.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from bench import record as schema  # noqa: E402

from hf_megatrain.model import loss_impl  # noqa: E402
from hf_megatrain.model.loss_impl import LossImpl, head_loss  # noqa: E402

IMPLS = ("chunked", "chunked_compiled", "liger", "cce")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _why_not(name: str, device: torch.device) -> str | None:
    if name.startswith("chunked"):
        return None
    return loss_impl.FUSED[LossImpl(name)].unavailable(device)


def _inputs(tokens: int, hidden: int, vocab: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Trained-model-like scales: logits of a few units, a peaked but not one-hot softmax.
    h = (torch.randn(1, tokens, hidden, generator=g) * 1.0).to(device)
    w = (torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)).to(device)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    labels[:, : tokens // 8] = -100  # a prompt share that does not count
    return h, w, labels.to(device)


def _run(name: str, h, w, labels, num_items: int, chunk: int, softcap: float | None):
    impl = LossImpl.CHUNKED if name.startswith("chunked") else LossImpl(name)
    hh = h.detach().requires_grad_()
    ww = w.detach().requires_grad_()
    loss = head_loss(impl, hh, ww, labels, bias=None, num_items_in_batch=num_items, chunk_tokens=chunk,
                     softcap=softcap, compiled=name == "chunked_compiled")
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _time(fn, warmup: int, iters: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def bench_case(tokens: int, args, device: torch.device) -> dict:
    h32, w32, labels = _inputs(tokens, args.hidden, args.vocab, device)
    num_items = int((labels[:, 1:] != -100).sum())
    case: dict = {"tokens": tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": "bfloat16",
                  "softcap": args.softcap, "counted_tokens": num_items, "impls": {}}
    # fp32 reference: the chunked loss (HF's ops per chunk) in fp32, TF32 off.
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _run("chunked", h32, w32, labels, num_items, args.chunk, args.softcap)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    case["reference_loss"] = float(ref[0])
    h, w = h32.to(torch.bfloat16), w32.to(torch.bfloat16)
    del h32, w32
    for name in args.impls:
        rec: dict = {}
        case["impls"][name] = rec
        why = _why_not(name, device)
        if why:
            rec["skipped"] = why
            print(f"[{tokens}] {name}: skipped ({why})", flush=True)
            continue
        try:
            loss, gh, gw = _run(name, h, w, labels, num_items, args.chunk, args.softcap)
            rec.update(loss=float(loss), loss_rel_err=abs(float(loss) - float(ref[0])) / abs(float(ref[0])),
                       grad_hidden_rel_err=_rel(gh, ref[1]), grad_weight_rel_err=_rel(gw, ref[2]))
            del loss, gh, gw
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            times = _time(lambda: _run(name, h, w, labels, num_items, args.chunk, args.softcap),
                          args.warmup, args.iters, device)
            rec["fwd_bwd_s"] = statistics.median(times)
            rec["fwd_bwd_s_all"] = times
            if device.type == "cuda":
                # inputs excluded; the gradients of hidden and weight (which every implementation returns) included
                rec["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
                rec["peak_extra_gib"] = rec["peak_extra_bytes"] / 2 ** 30
            print(f"[{tokens}] {name}: {rec['fwd_bwd_s'] * 1e3:.1f} ms, "
                  f"+{rec.get('peak_extra_gib', float('nan')):.2f} GiB, loss err {rec['loss_rel_err']:.2e}, "
                  f"dh err {rec['grad_hidden_rel_err']:.2e}, dW err {rec['grad_weight_rel_err']:.2e}", flush=True)
        except Exception as e:  # OOM, a kernel that does not compile here: recorded, the others still run
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-4000:]
            print(f"[{tokens}] {name}: error {rec['error'][:300]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return case


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8192,32768", help="comma-separated token counts (batch x sequence)")
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--chunk", type=int, default=4096, help="loss_chunk_tokens of the chunked loss")
    p.add_argument("--softcap", type=float, default=None, help="final-logit soft-cap (Gemma-style); default none")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small shapes (hidden 256, vocab 8192, 2k tokens)")
    p.add_argument("--json", default=None, help="output path (default $OUT/bench_loss.json, else ./bench_loss.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.vocab, args.tokens, args.chunk, args.warmup, args.iters = 256, 8192, "2048", 1024, 1, 2
    args.impls = [s for s in args.impls.split(",") if s]
    bad = [s for s in args.impls if s not in IMPLS]
    if bad:
        p.error(f"unknown --impls {bad}; choose from {IMPLS}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = args.json or os.path.join(os.environ.get("OUT", "."), "bench_loss.json")
    result = {**schema.header(__file__, argv, extra_versions=("liger-kernel", "cut-cross-entropy", "triton")),
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "liger_kernel": _version("liger-kernel"),
              "cut_cross_entropy": _version("cut-cross-entropy"), "triton": _version("triton"),
              "auto_choice": loss_impl.choose("auto", device, bias=False, softcap=args.softcap)[1], "cases": []}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        result["cases"].append(bench_case(tokens, args, device))
        schema.write(out, result)  # after every case: a later OOM or timeout keeps what was measured
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
