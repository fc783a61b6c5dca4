"""GRPO rollout throughput: ``model.generate()`` through the streamed layers (what GRPOTrainer calls for its
rollouts under hf_megatrain), bf16, every decoder layer streamed from the host (device_layers=0), beside the same
model whole on the GPU (plain HF generate) where it fits.

    python integration/probes/grpo_rollout.py --shape 8b --layers 8 --batches 8 32 128 256

Random-init Llama layers of a real model's shape (8b: Llama-3-8B, 70b: Llama-3-70B), fewer of them than the real
model (host memory and init time): a decoding step streams every layer once for the whole batch, so the step time
per layer measured here scales to the real layer count (the JSON's ``per_layer_step_ms`` and the extrapolations).
Fixed-length completions (EOS suppressed) after a fixed-length prompt; the layers frozen (a compute-dtype host copy:
the same bytes a trained model streams for its forward).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from transformers.initialization import no_init_weights

from hf_megatrain import MegaTrainConfig, MegaTrainEngine

SHAPES = {  # hidden, intermediate, heads, kv heads, vocab, real layer count
    "8b": (4096, 14336, 32, 8, 128256, 32),
    "70b": (8192, 28672, 64, 8, 128256, 80),
}


def build(shape: str, layers: int) -> transformers.PreTrainedModel:
    hidden, inter, heads, kv, vocab, _ = SHAPES[shape]
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with no_init_weights():
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # drawn on the GPU: a CPU bf16 normal_ of a 70B shape's ~5 B parameters takes minutes
        for p in model.parameters():
            p.copy_(torch.empty(p.shape, dtype=p.dtype, device="cuda").normal_(0.0, 0.02))
    model.requires_grad_(False)
    return model.eval()


def time_generate(model: torch.nn.Module, batch: int, prompt: int, new: int) -> float:
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        torch.cuda.synchronize()
    assert out.shape == (batch, prompt + new), out.shape
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--plain", action="store_true", help="also time plain HF generate, the model whole on the GPU")
    a = ap.parse_args()
    t0 = time.perf_counter()
    model = build(a.shape, a.layers)
    print(f"built {a.shape} x {a.layers} layers in {time.perf_counter() - t0:.1f} s", flush=True)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    out: dict = {"shape": a.shape, "layers": a.layers, "real_layers": SHAPES[a.shape][5], "prompt": a.prompt,
                 "new_tokens": a.new, "layer_bytes_bf16": layer_bytes, "device": torch.cuda.get_device_name(),
                 "streamed": [], "plain": []}
    if a.plain:
        plain = model.to("cuda")
        time_generate(plain, a.batches[0], a.prompt, 4)  # (warm-up)
        for b in a.batches:
            s = time_generate(plain, b, a.prompt, a.new)
            out["plain"].append({"batch": b, "wall_s": s, "tokens_per_s": b * a.new / s})
            print(json.dumps(out["plain"][-1]), flush=True)
        model = plain.to("cpu")
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    engine = MegaTrainEngine(model, MegaTrainConfig(compute_dtype="bfloat16", device_layers=0), device="cuda")
    print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    time_generate(engine.model, a.batches[0], a.prompt, 4)  # (warm-up)
    real = SHAPES[a.shape][5]
    for b in a.batches:
        s = time_generate(engine.model, b, a.prompt, a.new)
        step_ms = 1e3 * s / (a.new + 1)  # (the prefill counted as one more step: it streams every layer once too)
        per_layer = step_ms / a.layers
        row = {"batch": b, "wall_s": s, "tokens_per_s": b * a.new / s, "step_ms": step_ms,
               "per_layer_step_ms": per_layer, "h2d_gb_per_s_equiv": layer_bytes / (per_layer * 1e-3) / 1e9,
               f"extrapolated_{real}_layer_tokens_per_s": b / (per_layer * real * 1e-3)}
        out["streamed"].append(row)
        print(json.dumps(row), flush=True)
    out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
