"""Masked batches through FlexAttention in the streamed engine vs plain HF (SDPA), step by step (GPU): loss and
worst updated-weight error per step, for packed batches whose boundaries move (same and different totals) and
padded ones, with the layers compiled and eager. Prints one line per (case, mode, step).

    python integration/probes/masked_flex_parity.py [out.json]
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from transformers import DataCollatorWithFlattening

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_megatrain import MegaTrainConfig  # noqa: E402
from tests.models import tiny  # noqa: E402
from tests.parity import rel, train_batches_against_plain_hf  # noqa: E402

CASES = {
    "packed_moving_total": [(5, 9, 7), (5, 9, 8), (3, 12, 6)],
    "packed_same_total": [(5, 9, 7), (7, 9, 5), (10, 6, 5)],
}


def packed(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, 96, (n,), generator=g).tolist() for n in lengths]
    return DataCollatorWithFlattening()([{"input_ids": s, "labels": s} for s in seqs])


def padded(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(4, 96, (3, 16), generator=g)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, 9 - step:] = 0
    mask[2, 4 + step:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run(batches, compile_layers: bool, attn: str, load_as: str | None = None):
    torch.manual_seed(0)
    model = tiny("llama", hidden_size=64)
    if load_as:
        model.config._attn_implementation = load_as
    cfg = MegaTrainConfig(compute_dtype="float32", torch_compile=compile_layers, masked_attention=attn,
                          device_layers=0, device_step_layers=0)
    engine, rows = train_batches_against_plain_hf(model, batches, cfg)
    return [{"step": i, **r, "flex": engine.attention.flex} for i, r in enumerate(rows)]


def standalone(lengths) -> dict[str, float]:
    """transformers' packed BlockMask through torch.compile(flex_attention) outside the engine, against SDPA with
    the dense mask: is a wrong answer torch's (compiled flex with this mask_mod) or the engine's?"""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.masking_utils import create_causal_mask

    model = tiny("llama", hidden_size=64).cuda()
    batch = packed(lengths, 0)
    pos = batch["position_ids"].cuda()
    embeds = torch.zeros(1, pos.shape[1], 64, device="cuda")
    out = {}
    model.config._attn_implementation = "flex_attention"
    with torch.enable_grad():
        bm = create_causal_mask(model.config, embeds, None, None, position_ids=pos)
    model.config._attn_implementation = "sdpa"
    dense = create_causal_mask(model.config, embeds, None, None, position_ids=pos)
    q, k, v = (torch.randn(1, 4, pos.shape[1], 16, device="cuda") for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    out["eager_flex"] = rel(flex_attention(q, k, v, block_mask=bm).cpu(), ref.cpu())
    out["compiled_static"] = rel(torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=bm).cpu(), ref.cpu())
    torch._dynamo.reset()
    out["compiled_dynamic"] = rel(torch.compile(flex_attention, dynamic=True)(q, k, v, block_mask=bm).cpu(), ref.cpu())
    return out


def standalone_variants(lengths) -> dict[str, float]:
    """Narrowing the packed-flex error down outside the engine: GQA, transformers' flex_attention_forward, and a
    compiled function that projects q/k/v itself (as a layer does), each against SDPA with the dense mask."""
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.masking_utils import create_causal_mask
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    model = tiny("llama", hidden_size=64).cuda()
    pos = packed(lengths, 0)["position_ids"].cuda()
    t = pos.shape[1]
    embeds = torch.zeros(1, t, 64, device="cuda")
    model.config._attn_implementation = "flex_attention"
    with torch.enable_grad():
        bm = create_causal_mask(model.config, embeds, None, None, position_ids=pos)
    model.config._attn_implementation = "sdpa"
    dense = create_causal_mask(model.config, embeds, None, None, position_ids=pos)
    q = torch.randn(1, 4, t, 16, device="cuda")
    k, v = (torch.randn(1, 2, t, 16, device="cuda") for _ in range(2))
    kr, vr = (x.repeat_interleave(2, dim=1) for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=dense).cpu()
    out = {"gqa_compiled": rel(torch.compile(flex_attention)(q, k, v, block_mask=bm, enable_gqa=True).cpu(), ref)}

    class M(torch.nn.Module):
        training = False
    hf = lambda q, k, v, m: flex_attention_forward(M(), q, k, v, m, scaling=16 ** -0.5)[0]  # noqa: E731
    out["hf_forward_eager"] = rel(hf(q, k, v, bm).transpose(1, 2).cpu(), ref)
    torch._dynamo.reset()
    out["hf_forward_compiled"] = rel(torch.compile(hf)(q, k, v, bm).transpose(1, 2).cpu(), ref)
    x = torch.randn(1, t, 64, device="cuda")
    wq, wk, wv = torch.randn(64, 64, device="cuda") / 8, torch.randn(32, 64, device="cuda") / 8, \
        torch.randn(32, 64, device="cuda") / 8

    def layer(x, m, pos_in):
        qq = (x @ wq.T).view(1, t, 4, 16).transpose(1, 2)
        kk = (x @ wk.T).view(1, t, 2, 16).transpose(1, 2)
        vv = (x @ wv.T).view(1, t, 2, 16).transpose(1, 2)
        return hf(qq, kk, vv, m), pos_in + 0
    with torch.no_grad():
        want = hf(*(z for z in (
            (x @ wq.T).view(1, t, 4, 16).transpose(1, 2), (x @ wk.T).view(1, t, 2, 16).transpose(1, 2),
            (x @ wv.T).view(1, t, 2, 16).transpose(1, 2))), bm)
        torch._dynamo.reset()
        out["layer_like_compiled_nograd"] = rel(torch.compile(layer)(x, bm, pos)[0].cpu(), want.cpu())
    return out


def plain_hf_compiled_layers(lengths) -> dict[str, float]:
    """Plain HF (no engine) with each decoder layer ``torch.compile``d, flex_attention, one packed batch: the logits
    against the same model with SDPA. Wrong here = torch / transformers, right here = the engine's compiled call."""
    torch.manual_seed(0)
    base = tiny("llama", hidden_size=64).cuda()
    batch = {k: v.cuda() for k, v in packed(lengths, 0).items()}
    out = {}
    with torch.no_grad():
        ref = base(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    for training in (False, True):
        for dyn in (None, False):
            m = copy.deepcopy(base)
            m.set_attn_implementation("flex_attention")
            m.train(training)
            torch._dynamo.reset()
            for layer in m.model.layers:
                layer.compile(dynamic=dyn)
            with torch.no_grad():
                got = m(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            out[f"training={training}/dynamic={dyn}"] = rel(got.cpu(), ref.cpu())
    return out


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if "--diagnose" in sys.argv:
        from hf_megatrain.core import compiling

        sys.argv.remove("--diagnose")
        print("plain_hf_compiled_layers", plain_hf_compiled_layers((5, 9, 7)), flush=True)
        print("variants", standalone_variants((5, 9, 7)), flush=True)
        batches = [packed(l, i) for i, l in enumerate(CASES["packed_moving_total"])]
        print("hf_flex_attention_model_compiled", run(batches, True, "model", "flex_attention")[0], flush=True)
        return
        compiling.DYNAMIC_SHAPES = False
        torch._dynamo.reset()
        print("static_shapes", run(batches, True, "flex")[0], flush=True)
        compiling.DYNAMIC_SHAPES = True
        from torch._inductor import ir

        ir.is_aligned_realized_tensor._megatrain_no_guard = True  # (keeps compile_fn from patching it)
        torch._dynamo.reset()
        print("dynamic_no_alignment_patch", run(batches, True, "flex")[0], flush=True)
        return
    res = {}
    for name, lens in CASES.items():
        batches = [packed(l, i) for i, l in enumerate(lens)]
        for comp, attn in ((True, "flex"), (False, "flex"), (True, "model")):
            key = f"{name}/compile={comp}/{attn}"
            res[key] = run(batches, comp, attn)
            for r in res[key]:
                print(key, r, flush=True)
    for comp, attn in ((True, "flex"), (True, "model")):
        key = f"padded/compile={comp}/{attn}"
        res[key] = run([padded(i) for i in range(3)], comp, attn)
        for r in res[key]:
            print(key, r, flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
