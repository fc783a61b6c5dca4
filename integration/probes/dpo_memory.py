"""DPO through the engine on CUDA, bf16 compute: peak GPU memory of training steps beside the size the full logits
of the concatenated pair batch would take (what TRL's fused head never forms), and the step time.

    python integration/probes/dpo_memory.py --layers 8 --hidden 2048 --vocab 128256 --seq 1024 --pairs 2

Random-init Llama (no Hub), every layer streamed (device_layers=0), reference precomputed by the same engine.
"""

from __future__ import annotations

import argparse
import json
import time

import datasets
import tokenizers
import torch
import transformers

from hf_megatrain.hf.dpo_support import MegaTrainDPOConfig, MegaTrainDPOTrainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                                   num_hidden_layers=a.layers, num_attention_heads=a.hidden // 128,
                                   num_key_value_heads=max(1, a.hidden // 512), max_position_embeddings=2 * a.seq)
    model = transformers.LlamaForCausalLM(cfg)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(a.vocab)}, unk_token="t3"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3")
    g = torch.Generator().manual_seed(0)

    def words(k: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(4, a.vocab, (k,), generator=g).tolist())

    n = a.pairs * a.steps
    half = a.seq // 2
    data = datasets.Dataset.from_list([{"prompt": words(half) + " ", "chosen": words(half - 1),
                                        "rejected": words(half - 1)} for _ in range(n)])
    args = MegaTrainDPOConfig(output_dir="/tmp/dpo_memory", per_device_train_batch_size=a.pairs, max_steps=a.steps,
                              precompute_ref_log_probs=True, bf16=True, report_to=[], save_strategy="no",
                              logging_steps=1, max_length=a.seq, disable_tqdm=True,
                              megatrain_config={"device_layers": 0, "device_step_layers": 0})
    trainer = MegaTrainDPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = 2 * a.pairs * a.seq
    out = {"layers": a.layers, "hidden": a.hidden, "vocab": a.vocab, "seq": a.seq, "pairs": a.pairs,
           "params": trainer.engine.num_parameters(include_frozen=True),
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
           "full_logits_fp32_gib": tokens * a.vocab * 4 / 2**30,
           "train_wall_s": wall, "steps": a.steps,
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "device": torch.cuda.get_device_name()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
