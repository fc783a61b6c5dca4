"""Real widths, not only tiny ones: one or two decoder layers of the largest named Hub models at full width through
the streamed path, against the plain HF model (issue 32, "Real shapes").

For each model (``integration/hub_configs/<name>.json``, the numbers of its Hub ``config.json``) the config is cut to
``--layers`` decoder layers (every width kept: hidden, heads, all experts; Llama 4: its text model, as the repo's
loader builds it) and ``vocab_size`` to ``--vocab`` (32768: lm_head of a 200k vocab is GPU memory the check does not
need, the check is about the decoder layer; the JSON says so). The skeleton is built on ``meta`` and materialised
on the GPU with a seeded N(0, 0.02) draw in bf16 (norms 1, biases 0). Then, on one fixed random batch
(``--batch`` x ``--seq`` tokens, labels = inputs):

(a) the plain HF model on the GPU in bf16: loss, every parameter gradient, the gradient of the first layer's input
    (the embedding output), peak GPU memory, the forward+backward time (a second, warm pass);
(b) the same weights through ``MegaTrainEngine`` with every layer streamed (``device_layers=0,
    device_step_layers=0``, bf16 compute, FP32 master): the same quantities, the time of every layer visit
    (CUDA events around the executor's forward / backward of each layer, on a second, warm pass).

Pass: loss within 1e-2 relative, the input gradient and every parameter gradient within 2e-2 relative
(||ours - plain|| / ||plain||; the plain model keeps bf16 gradients, the engine FP32 ones); a gradient whose plain
norm is below 1e-6 of the total (k_proj.bias: softmax is shift-invariant) holds rounding noise only and is recorded,
not judged. Each model runs in its own process with a timeout, and is skipped with a record where the estimate
(planner host and GPU bytes of the engine; weights, gradients and a rough activation count of the plain model) does
not fit the machine or the ``--budget`` has no room left. One JSON per model under ``--out``, with the command and
versions, and a summary.

    python integration/full_width_layers.py --out $OUT/full_width_layers --budget 540   # H100, ~5-7 minutes
    python integration/full_width_layers.py --plan-only               # the estimates and skip decisions only
    python integration/full_width_layers.py --tiny --out /tmp/fwl    # CPU smoke, fp32, tolerance 1e-5 (seconds)

``--layers 0`` (default) keeps two layers where the host holds them (one layer hands off to the next through the
slots), else one (the first: gpt-oss's sliding-window layer, Llama 4's chunked-RoPE layer). ``--tiny`` divides the
widths down (TINY) and runs in this process; ``--tiny --dtype bfloat16`` checks the bf16 path's code on a CPU,
``--tiny --spawn`` the subprocess path. The per-model record keeps the cut config, the attention / experts
implementation transformers chose, the loss kernel, every gradient's relative error and the phase times.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402

from bench import record as schema  # noqa: E402
from bench.common import GIB, runner_main  # noqa: E402
from bench.record import gpu_slug  # noqa: E402
from named_models import CONFIGS, load_meta  # noqa: E402
from scale_123b import LayerTimer, child_env, spawn  # noqa: E402

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, planner  # noqa: E402
from hf_megatrain.core.memory import available_host_bytes  # noqa: E402
from hf_megatrain.model.layers import find_layer_stack  # noqa: E402

DEFAULT_MODELS = ("gpt-oss-120b", "llama-4-scout", "qwen3-235b-a22b", "mistral-large-2", "dbrx")
TOL_BF16 = {"loss": 1e-2, "grad": 2e-2, "input_grad": 2e-2}
TOL_TINY = {"loss": 1e-5, "grad": 1e-5, "input_grad": 1e-5}
NULL_GRAD = 1e-6  # a plain gradient below this fraction of the total norm is rounding noise: recorded, not judged
HOST_MARGIN = 12 * GIB  # what the process, the CUDA context and transformers need besides the planned bytes
GPU_MARGIN = 4 * GIB
# Config keys a tiny smoke shrinks (every config form these models use: flat, text_config, DBRX's sub-configs).
TINY = {"hidden_size": 64, "d_model": 64, "intermediate_size": 48, "intermediate_size_mlp": 96,
        "moe_intermediate_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4, "n_heads": 4,
        "num_key_value_heads": 2, "kv_n_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts": 4,
        "moe_num_experts": 4, "sliding_window": 8, "attention_chunk_size": 16}
TINY_TOPK = ("num_experts_per_tok", "experts_per_token", "moe_top_k")


# -- the model ---------------------------------------------------------------------------------------------------------
def _cut(d: dict[str, Any], layers: int, vocab: int, tiny: bool) -> None:
    """In place on one config level: ``layers`` layers (per-layer lists cut alike), ``vocab`` tokens (token ids past
    it moved inside: an embedding's padding_idx must be a row), tiny widths when asked."""
    for key in ("num_hidden_layers", "n_layers"):
        if key in d:
            d[key] = layers
    for key in ("layer_types", "no_rope_layers"):
        if isinstance(d.get(key), list):
            d[key] = d[key][:layers]
    if isinstance(d.get("moe_layers"), list):
        d["moe_layers"] = [i for i in d["moe_layers"] if i < layers]
    if "max_window_layers" in d:
        d["max_window_layers"] = min(d["max_window_layers"], layers)
    if vocab and "vocab_size" in d:
        d["vocab_size"] = vocab
        if d.get("pad_token_id") is not None:
            d["pad_token_id"] = None
        for key, v in list(d.items()):
            if key.endswith(("_token_id", "_token_index")) and isinstance(v, int) and v >= vocab:
                d[key] = vocab - 1
            elif key.endswith("_token_id") and isinstance(v, list):
                d[key] = [min(x, vocab - 1) for x in v]
    if tiny:
        for key, v in TINY.items():
            if isinstance(d.get(key), int):
                d[key] = v
        for key in TINY_TOPK:
            if isinstance(d.get(key), int):
                d[key] = min(d[key], 2)
    for key in ("text_config", "attn_config", "ffn_config"):
        if isinstance(d.get(key), dict):
            _cut(d[key], layers, vocab, tiny)


def config_values(model: str, layers: int, vocab: int, tiny: bool) -> dict[str, Any]:
    """The Hub config.json values of ``model`` cut to ``layers`` layers and ``vocab`` tokens (tiny: small widths)."""
    _, values = load_meta(CONFIGS / f"{model}.json")
    values = copy.deepcopy(values)
    _cut(values, layers, vocab, tiny)
    return values


def skeleton(values: dict[str, Any]) -> torch.nn.Module:
    """The causal LM of ``values`` as the repo's loader builds it (named_models.build), parameters on ``meta``,
    buffers (rotary tables) real."""
    import transformers
    from accelerate import init_empty_weights

    from hf_megatrain.model.skeleton import causal_lm_skeleton

    cfg = transformers.CONFIG_MAPPING[values["model_type"]].from_dict(values)
    with warnings.catch_warnings(), init_empty_weights(include_buffers=False):
        warnings.simplefilter("ignore")
        model = causal_lm_skeleton(cfg)
    model.tie_weights()
    return model


def materialise(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    """Every meta parameter drawn on ``device`` (norm weights 1, biases 0, the rest N(0, 0.02) drawn in bf16), in
    model order from one seeded generator: the same weights on every run."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, module in model.named_modules():
            norm = "norm" in type(module).__name__.lower()
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                if norm and pname == "weight":
                    value = torch.ones(p.shape, dtype=torch.bfloat16, device=device)
                elif pname.endswith("bias"):
                    value = torch.zeros(p.shape, dtype=torch.bfloat16, device=device)
                else:
                    value = torch.empty(p.shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
                module._parameters[pname] = torch.nn.Parameter(value.to(dtype))
    model.to(device)  # buffers (rotary tables)
    model.train()


def megatrain_config(spec: dict[str, Any]) -> MegaTrainConfig:
    # (saved_graph_layers=0: a few of the model's layers stand for all of them; their forward graphs would fit
    # where a full-depth model's would not)
    return MegaTrainConfig.from_dict({"compute_dtype": spec["dtype"],
                                      "device_layers": 0, "device_step_layers": 0, "saved_graph_layers": 0,
                                      **(spec.get("megatrain_config") or {})})


# -- estimate ----------------------------------------------------------------------------------------------------------
def estimate(spec: dict[str, Any]) -> dict[str, Any]:
    """Bytes before running: the engine's (planner, this config, this batch), the plain model's on the GPU (bf16
    weights + gradients + a rough activation count) and the host's extra copies (the plain model's layers moved to
    the host in bf16 before conversion, its gradients kept there as the reference)."""
    values = config_values(spec["model"], spec["layers"], spec["vocab"], spec["tiny"])
    model = skeleton(values)
    shape = planner.ModelShape.from_model(model)
    cfg = model.config.get_text_config()
    n_all = sum(p.numel() for p in model.parameters())
    n_layers = sum(p.numel() for p in find_layer_stack(model, None).layers.parameters())
    c = torch.empty((), dtype=getattr(torch, spec["dtype"])).element_size()
    t = spec["batch"] * spec["seq"]
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "d_model")
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads")
    # rough, per layer: ~24 hidden-sized tensors, one eager attention score matrix (scores + fp32 softmax), the
    # routed tokens' expert activations; head: fp32 logits and their gradient
    inter = max(int(getattr(cfg, k, 0) or 0) for k in ("intermediate_size", "moe_intermediate_size"))
    topk = int(getattr(cfg, "num_experts_per_tok", 1) or 1)
    act = spec["layers"] * (t * hidden * c * 24 + spec["batch"] * heads * spec["seq"] ** 2 * (c + 4)
                            + t * topk * inter * c * 6) + t * spec["vocab"] * 4 * 3
    plain_gpu = n_all * c * 2 + act
    dev = "cpu" if spec["tiny"] else "cuda"
    gpu_free = None if spec["tiny"] else int(spec.get("gpu_total_bytes") or 80 * GIB)
    plan = planner.estimate(shape, megatrain_config(spec), spec["seq"], spec["batch"], device_type=dev,
                            gpu_free=gpu_free, source_bytes=n_layers * c)
    host = plan.host_total + n_all * c  # + the plain model's gradients kept on the host (the plan counts the source)
    return {"params": n_all, "layer_params": n_layers, "params_per_layer": n_layers // spec["layers"],
            "active_params": shape.active, "class": type(model).__name__,
            "plain_gpu_gib": plain_gpu / GIB, "engine_gpu_gib": plan.device_total / GIB,
            "engine_gpu_peak_phase": plan.peak_phase, "host_gib": host / GIB, "engine_host_gib": plan.host_total / GIB}


# -- one run (child) ----------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def rel_error(ours: torch.Tensor, ref: torch.Tensor, device: torch.device, chunk: int = 1 << 26) -> tuple[float, float]:
    """(||ours - ref|| / ||ref||, ||ref||) in float64, a chunk at a time on ``device`` (an expert tensor of gpt-oss
    holds 2.1e9 elements: a whole float64 copy on the host would be 17 GB)."""
    a, b = ours.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for i in range(0, b.numel(), chunk):
        x = a[i:i + chunk].to(device, torch.float64, non_blocking=False)
        y = b[i:i + chunk].to(device, torch.float64, non_blocking=False)
        num += float((x - y).pow(2).sum())
        den += float(y.pow(2).sum())
    return (num ** 0.5) / max(den ** 0.5, 1e-30), den ** 0.5


class InputGrad:
    """The gradient of the first decoder layer's input (the embedding output: these models add nothing between)."""

    def __init__(self, embedding: torch.nn.Module) -> None:
        self.out: torch.Tensor | None = None
        self.handle = embedding.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.retain_grad()
            self.out = out

    def take(self) -> torch.Tensor | None:
        grad = None if self.out is None or self.out.grad is None else self.out.grad.detach().cpu().clone()
        self.out = None
        return grad


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cpu") if spec["tiny"] or not torch.cuda.is_available() else torch.device("cuda")
    dtype = getattr(torch, spec["dtype"])
    tol = TOL_TINY if dtype == torch.float32 else TOL_BF16
    rec: dict[str, Any] = {"model": spec["model"], "layers": spec["layers"], "tolerances": tol, "times_s": {}}
    times = rec["times_s"]
    t = time.perf_counter()
    values = config_values(spec["model"], spec["layers"], spec["vocab"], spec["tiny"])
    model = skeleton(values)
    materialise(model, device, dtype, int(spec.get("seed", 0)))
    cfg = model.config.get_text_config()
    rec.update(config=values, attn_implementation=getattr(cfg, "_attn_implementation", None),
               experts_implementation=getattr(cfg, "_experts_implementation", None),
               layer_types=(getattr(cfg, "layer_types", None) or [])[:spec["layers"]], cls=type(model).__name__)
    _sync(device)
    times["build"] = time.perf_counter() - t
    vocab = int(cfg.vocab_size)
    ids = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1234))
    n_items = spec["batch"] * (spec["seq"] - 1)

    # (a) the plain model
    hook = InputGrad(model.get_input_embeddings())
    def plain_pass(key: str) -> Any:  # one forward+backward of the plain model, timed into times[key]
        t = time.perf_counter()
        out = model(input_ids=ids.to(device), labels=ids.to(device),
                    num_items_in_batch=torch.tensor(n_items, device=device))
        out.loss.backward()
        _sync(device)
        times[key] = time.perf_counter() - t
        return out

    _reset_peak(device)
    out = plain_pass("plain_fwd_bwd_first")
    rec["plain_peak_gpu_gib"] = _peak(device)
    ref_loss = float(out.loss.detach())
    ref_input = hook.take()
    # (the host copy of a GPU gradient is new memory; a CPU gradient is cloned, as zero_grad may reuse it)
    ref = {n: (None if p.grad is None else p.grad.detach().cpu() if device.type == "cuda" else p.grad.detach().clone())
           for n, p in model.named_parameters()}
    del out
    model.zero_grad(set_to_none=True)
    plain_pass("plain_fwd_bwd")  # (its output dropped at once)
    hook.take()
    hook.handle.remove()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":  # the model goes to the host as from_pretrained gives it: the engine's usual input
        model.to("cpu")
        torch.cuda.empty_cache()

    # (b) the same weights through the engine, every layer streamed
    t = time.perf_counter()
    engine = MegaTrainEngine(model, megatrain_config(spec), device=device)
    times["engine_build"] = time.perf_counter() - t
    rec["loss_impl"] = str(getattr(engine.head_extras, "loss_impl", None))
    rec["engine_plans"] = {"device_layers": len(engine.plans.kept), "device_step_layers":
                           len(engine.plans.device_stepped), "resident_on_device": engine.plans.resident_on_device}
    hook = InputGrad(model.get_input_embeddings())
    timer = LayerTimer(engine.executor, spec["layers"], device.type == "cuda")
    _reset_peak(device)
    t = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids, num_items_in_batch=n_items).loss
    loss.backward()
    engine.land_gradients()
    _sync(device)
    times["engine_fwd_bwd_first"] = time.perf_counter() - t
    rec["engine_peak_gpu_gib"] = _peak(device)
    timer.collect()
    ours_loss = float(loss.detach())
    ours_input = hook.take()

    # compare
    rec["loss"] = {"plain": ref_loss, "engine": ours_loss, "rel": abs(ours_loss - ref_loss) / max(abs(ref_loss), 1e-30)}
    cmp_dev = device
    if ours_input is None or ref_input is None:
        rec["input_grad"] = {"rel": None, "error": "no gradient reached the embedding output"}
    else:
        r, norm = rel_error(ours_input, ref_input, cmp_dev)
        rec["input_grad"] = {"rel": r, "plain_norm": norm}
    norms: dict[str, float] = {}
    grads: dict[str, dict[str, Any]] = {}
    for name, g in ref.items():
        if name not in engine.store.by_name:
            grads[name] = {"rel": None, "error": "not among the engine's trainable parameters"}
            continue
        unit, ps = engine.store.by_name[name]
        if unit.grad is None:
            grads[name] = {"rel": None, "error": "the engine keeps no gradient for this unit"}
            continue
        mine = unit.view(unit.grad, ps)
        if g is None:  # unused by the plain forward: the engine's must be zero
            grads[name] = {"rel": None, "unused": True, "engine_max_abs": float(mine.abs().max())}
            continue
        r, norm = rel_error(mine, g, cmp_dev)
        norms[name] = norm
        grads[name] = {"rel": r, "plain_norm": norm, "shape": list(g.shape)}
    total = sum(n * n for n in norms.values()) ** 0.5
    for name, n in norms.items():
        grads[name]["null"] = n < NULL_GRAD * total
    judged = {n: v for n, v in grads.items() if v.get("rel") is not None and not v.get("null")}
    worst = max(judged.items(), key=lambda kv: kv[1]["rel"], default=(None, {"rel": None}))
    rec["grads"] = grads
    rec["worst_grad"] = {"name": worst[0], "rel": worst[1]["rel"]}
    bad_unused = [n for n, v in grads.items() if v.get("unused") and v["engine_max_abs"] != 0.0]
    missing = [n for n, v in grads.items() if v.get("error")]
    checks = {"loss": rec["loss"]["rel"] <= tol["loss"],
              "input_grad": rec["input_grad"]["rel"] is not None and rec["input_grad"]["rel"] <= tol["input_grad"],
              "grads": bool(judged) and worst[1]["rel"] <= tol["grad"] and not bad_unused and not missing}
    rec["checks"] = checks
    rec["match"] = all(checks.values())
    del ref

    # a second, warm pass through the engine: the layer visits' times (gradients accumulate; already compared)
    _reset_peak(device)
    t = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids, num_items_in_batch=n_items).loss
    loss.backward()
    _sync(device)
    times["engine_fwd_bwd"] = time.perf_counter() - t
    visits = timer.collect()
    rec["layer_visit_s"] = visits
    rec["layer_visit_total_s"] = [f + b for f, b in zip(visits["forward"], visits["backward"])]
    rec["engine_peak_gpu_gib_warm"] = _peak(device)
    print(f"[{spec['model']}] loss {ref_loss:.5f} / {ours_loss:.5f}, input grad {rec['input_grad']['rel']}, "
          f"worst grad {rec['worst_grad']}, match {rec['match']}", flush=True)
    return rec


# -- parent: estimate, run each model bounded, write the records ----------------------------------------------------
def _fits(est: dict[str, Any], spec: dict[str, Any], host_avail: int, gpu_total: int | None) -> str | None:
    """Why the run cannot fit this machine, or None."""
    if est["host_gib"] * GIB + HOST_MARGIN > host_avail:
        return (f"host: {est['host_gib']:.1f} GiB estimated + {HOST_MARGIN / GIB:.0f} GiB margin > "
                f"{host_avail / GIB:.1f} GiB available")
    if gpu_total is not None:
        for key in ("plain_gpu_gib", "engine_gpu_gib"):
            if est[key] * GIB + GPU_MARGIN > gpu_total:
                return f"GPU: {key} {est[key]:.1f} GiB estimated + margin > {gpu_total / GIB:.1f} GiB"
    return None


def auto_layers(spec: dict[str, Any], host_avail: int, gpu_total: int | None) -> tuple[int, dict[str, Any]]:
    """Two layers (one layer's hand-off to the next through the slots) where they fit, else one."""
    for layers in (2, 1):
        est = estimate({**spec, "layers": layers})
        if layers == 1 or _fits(est, {**spec, "layers": layers}, host_avail, gpu_total) is None:
            return layers, est
    raise AssertionError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated hub_configs names (file stems), e.g. qwen3-30b-a3b,dbrx")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: two where they fit, else one)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocab_size cut to this (0: the model's own)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=200.0, help="seconds per model (its subprocess is killed)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole command")
    ap.add_argument("--megatrain-config", default=None, help="JSON of MegaTrainConfig overrides")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "full_width_layers"))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: the same code at small widths, fp32, tol 1e-5")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="weights and compute (default: bfloat16, with --tiny float32)")
    ap.add_argument("--in-process", action="store_true", help="run each model in this process (default with --tiny)")
    ap.add_argument("--spawn", action="store_true", help="a subprocess per model also with --tiny")
    ap.add_argument("--plan-only", action="store_true", help="estimates and skip decisions only, no run")
    # The budget counts from the process start (imports included) when run as a command, from this call when
    # called in-process (a test session imports the module long before).
    start = T_START if argv is None else time.perf_counter()
    a = ap.parse_args(argv)
    if a.tiny and a.seq == 4096:
        a.seq = 32
    if a.tiny and a.vocab == 32768:
        a.vocab = 128
    in_process = a.in_process or (a.tiny and not a.spawn)
    a.dtype = a.dtype or ("float32" if a.tiny else "bfloat16")
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in models if not (CONFIGS / f"{m}.json").exists()]
    if unknown:
        raise SystemExit(f"no config for {unknown}: choose from {sorted(p.stem for p in CONFIGS.glob('*.json'))}")
    import transformers

    transformers.logging.set_verbosity_error()
    os.makedirs(a.out, exist_ok=True)
    info = schema.machine()
    host_avail = available_host_bytes()
    # (from nvidia-smi: a CUDA context in this parent would take GPU memory from every child)
    gpu_total = None if a.tiny else int(info["gpu_total_gib"] * GIB) if info.get("gpu") else 80 * GIB
    gpu_name, slug = gpu_slug(a.tiny)
    common = {**schema.header(__file__, argv, host=info),
              "vocab_note": f"vocab_size cut to {a.vocab} (lm_head / embeddings only; "
              "every decoder-layer width is the Hub config's)" if a.vocab else "vocab_size as published"}
    records = []
    for m in models:
        spec = {"model": m, "layers": a.layers, "vocab": a.vocab, "seq": a.seq, "batch": a.batch, "tiny": a.tiny,
                "dtype": a.dtype, "seed": 0, "megatrain_config": json.loads(a.megatrain_config) if a.megatrain_config else None,
                "gpu_total_bytes": gpu_total}
        path = os.path.join(a.out, f"{m}_{slug}.json")
        rec: dict[str, Any] = {"model": m, "spec": spec}
        try:
            if a.layers:
                spec["layers"], est = a.layers, estimate(spec)
            else:
                spec["layers"], est = auto_layers(spec, host_avail, gpu_total)
            rec["estimate"] = est
            why = _fits(est, spec, host_avail, gpu_total)
        except Exception as e:  # noqa: BLE001 - a config that does not build is a record, not a crash
            rec.update(status="error", error=f"estimate: {type(e).__name__}: {e}"[:2000])
            why = "error"
        left = a.budget - (time.perf_counter() - start)
        if rec.get("status") == "error":
            pass
        elif why is not None:
            rec.update(status="skipped", reason=why)
        elif a.plan_only:
            rec.update(status="planned")
        elif left < 30:
            rec.update(status="skipped", reason=f"budget: {left:.0f} s left of --budget {a.budget:.0f}")
        elif in_process:
            try:
                rec.update(run_one(spec), status="ok")
            except Exception as e:  # noqa: BLE001
                rec.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
        else:
            log = os.path.join(a.out, f"{m}_{slug}.log")
            child = spawn(spec, min(a.timeout, left - 5), log, child_env("expandable_segments:True"), __file__)
            rec.update({k: v for k, v in child.items() if k not in ("spec", "batch", "system")})
        if rec.get("status") == "ok" and not rec.get("match"):
            rec["status"] = "mismatch"
        schema.write(path, {**common, **rec})
        records.append(rec)
        est = rec.get("estimate") or {}
        print(f"[full_width] {m}: {rec.get('status')} layers={spec['layers']} "
              f"params/layer={est.get('params_per_layer', 0) / 1e9:.2f}B est host {est.get('host_gib', 0):.0f} GiB "
              f"plain GPU {est.get('plain_gpu_gib', 0):.1f} GiB engine GPU {est.get('engine_gpu_gib', 0):.1f} GiB"
              + (f" | loss rel {rec['loss']['rel']:.2e} input grad {rec['input_grad']['rel']} worst grad "
                 f"{rec['worst_grad']['rel']} ({rec['worst_grad']['name']}) peak GPU plain "
                 f"{rec.get('plain_peak_gpu_gib')} engine {rec.get('engine_peak_gpu_gib')} layer visits "
                 f"{rec.get('layer_visit_total_s')}" if "loss" in rec else "")
              + (f" | {rec.get('reason') or (rec.get('error') or '')[:300]}" if rec.get("status") != "ok" else ""),
              flush=True)
    summary = [{k: r.get(k) for k in ("model", "status", "reason", "layers", "match", "checks", "worst_grad",
                                      "layer_visit_total_s", "plain_peak_gpu_gib", "engine_peak_gpu_gib")}
               | {"loss_rel": (r.get("loss") or {}).get("rel"), "input_grad_rel": (r.get("input_grad") or {}).get("rel")}
               for r in records]
    schema.write(os.path.join(a.out, f"summary_{slug}.json"), {**common, "gpu": gpu_name, "runs": summary,
                                                               "wall_s": time.perf_counter() - start})
    ok = {"ok", "planned"} if not a.tiny else {"ok"}
    return 0 if all(r.get("status") in ok or r.get("status") == "skipped" and not a.tiny for r in records) else 1


if __name__ == "__main__":
    if "--spec" in sys.argv:
        runner_main("full_width_layers", run_one)
    sys.exit(main())
