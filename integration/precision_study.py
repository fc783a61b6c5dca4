"""Multi-seed convergence study of the precision choices (issue 17, item 4): plain HF Trainer with bf16 autocast
vs hf_megatrain (bf16 compute, FP32 masters) with the default store and with the lean store.

HF's autocast keeps the residual stream, norms and softmax in fp32 and runs the matmuls in bf16; hf_megatrain's
bf16 layers compute purely in bf16 from FP32 masters (one rounding of the weights per visit, fp32 AdamW). The
question is whether that difference shows in training at all, i.e. whether it is inside the seed-to-seed spread.

The task: a ~24M-parameter Llama (hidden 512, 8 layers, GQA) on the generated-English story corpus behind
hf_megatrain's embedded default job (``hf_megatrain.hf.default_job.generate_corpus``: templates, deterministic,
unbounded, so no epoch repeats), tokenized with the shipped 512-token BPE and packed into blocks. Per seed the
three systems start from the same initial weights and see the same batches in the same order (Trainer's sampler
seed), so their per-seed differences pair up. Recorded per run: the train loss curve, the eval loss curve on a
fixed held-out set and the final eval loss; reported per system: mean +- std over seeds, and per pair: the paired
difference of final eval losses (mean +- std) against the reference's seed-to-seed std.

    python integration/precision_study.py --out integration/results/precision_study/<date>_<commit>_precision_study_<gpu>     # GPU: < 4 min
    python integration/precision_study.py --tiny --out /tmp/ps                              # CPU smoke test

Writes ``<out>/precision_study.json`` and ``<out>/precision_study.md``. Needs torch, transformers, accelerate and
the shipped tokenizer only (no datasets). ``--placement streamed`` (default) streams every layer and steps AdamW
on the CPU, the path of models larger than the GPU; ``auto`` takes the engine's placement (this model fits: kept
on the GPU). Both compute the same way.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from bench import record as schema  # noqa: E402

SYSTEMS = ("hf_autocast_bf16", "megatrain_default", "megatrain_lean")
MODEL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4)
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def blocks(tokenizer, stories: int, seed: int, seq: int) -> list[torch.Tensor]:
    """``stories`` generated stories, tokenized, joined with EOS and cut into ``seq``-token blocks."""
    from hf_megatrain.hf.default_job import generate_corpus

    ids: list[int] = []
    for text in generate_corpus(stories, seed):
        ids.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
    n = len(ids) // seq
    return list(torch.tensor(ids[: n * seq]).view(n, seq))


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build_model(tokenizer, seed: int, tiny: bool):
    from hf_megatrain.hf.default_job import tiny_llama_config
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(tokenizer, **(TINY_MODEL if tiny else MODEL))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1000 + seed)
    return LlamaForCausalLM(cfg).float()


def train_one(system: str, model, train, evald, seed: int, args, out_dir: str) -> dict[str, Any]:
    import transformers
    from hf_megatrain import MegaTrainTrainer, MegaTrainTrainingArguments

    common = dict(output_dir=os.path.join(out_dir, "runs", f"{system}_s{seed}"), per_device_train_batch_size=args.batch,
                  per_device_eval_batch_size=args.batch, max_steps=args.steps, learning_rate=args.lr,
                  weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=args.warmup,
                  adam_beta2=0.95, logging_steps=args.log_every, eval_strategy="steps", eval_steps=args.eval_every,
                  report_to=[], save_strategy="no", seed=seed, data_seed=seed, disable_tqdm=True,
                  dataloader_num_workers=0, bf16=True, use_cpu=not torch.cuda.is_available())
    if system == "hf_autocast_bf16":
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common),
                                       train_dataset=train, eval_dataset=evald)
    else:
        cfg: dict[str, Any] = {"lean_store": system == "megatrain_lean"}
        if args.placement == "streamed":
            cfg.update(device_layers=0, device_step_layers=0)
        trainer = MegaTrainTrainer(model=model, args=MegaTrainTrainingArguments(**common, megatrain_config=cfg),
                                   train_dataset=train, eval_dataset=evald)
    t0 = time.perf_counter()
    trainer.train()
    final = trainer.evaluate()["eval_loss"]
    wall = time.perf_counter() - t0
    hist = trainer.state.log_history
    rec = {"system": system, "seed": seed, "wall_s": wall, "final_eval_loss": final,
           "train_loss": [(h["step"], h["loss"]) for h in hist if "loss" in h],
           "eval_loss": [(h["step"], h["eval_loss"]) for h in hist if "eval_loss" in h]}
    if system != "hf_autocast_bf16":
        eng = trainer.engine
        rec["compute_dtype"] = str(eng.compute_dtype)
        rec["placement"] = {"kept": len(eng.plans.kept), "device_stepped": len(eng.plans.device_stepped),
                            "layers": len(eng.layer_units)}
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    final = {s: [next(r["final_eval_loss"] for r in runs if r["system"] == s and r["seed"] == k) for k in seeds]
             for s in SYSTEMS}
    per_system = {s: dict(zip(("mean", "std"), _mean_std(v)), values=v) for s, v in final.items()}
    ref = SYSTEMS[0]
    spread = per_system[ref]["std"]
    pairs = {}
    for s in SYSTEMS[1:]:
        diffs = [a - b for a, b in zip(final[s], final[ref])]
        m, sd = _mean_std(diffs)
        pairs[f"{s} - {ref}"] = {"paired_diffs": diffs, "mean": m, "std": sd, "reference_seed_std": spread,
                                 "within_seed_spread": abs(m) <= spread}
    m, sd = _mean_std([a - b for a, b in zip(final["megatrain_lean"], final["megatrain_default"])])
    pairs["megatrain_lean - megatrain_default"] = {"mean": m, "std": sd, "reference_seed_std": spread,
                                                   "within_seed_spread": abs(m) <= spread}
    return {"per_system": per_system, "pairs": pairs,
            "verdict": all(p["within_seed_spread"] for p in pairs.values())}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    a = result["args"]
    lines = ["# Precision study: HF autocast bf16 vs hf_megatrain bf16 (default / lean store)", "",
             f"{result['params'] / 1e6:.1f}M-parameter Llama, {len(a['seeds'])} seeds, {a['steps']} steps of "
             f"{a['batch']} x {a['seq']} tokens, lr {a['lr']} cosine, device {result['device']}, "
             f"placement {a['placement']}, total wall {result['wall_s']:.0f} s.", "",
             "| system | final eval loss (mean +- std over seeds) | per seed |", "|---|---|---|"]
    for name, v in s["per_system"].items():
        lines.append(f"| {name} | {v['mean']:.4f} +- {v['std']:.4f} | {', '.join(f'{x:.4f}' for x in v['values'])} |")
    lines += ["", "| paired difference (same seed, same data) | mean +- std | reference seed-to-seed std | within |",
              "|---|---|---|---|"]
    for name, p in s["pairs"].items():
        lines.append(f"| {name} | {p['mean']:+.4f} +- {p['std']:.4f} | {p['reference_seed_std']:.4f} | "
                     f"{'yes' if p['within_seed_spread'] else 'NO'} |")
    lines += ["", f"Verdict: the systems' differences are {'inside' if s['verdict'] else 'OUTSIDE'} the "
              "seed-to-seed spread of the HF autocast reference.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for precision_study.json / .md")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=150)  # (3 seeds x 3 systems: 180 s on the H100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--train-stories", type=int, default=30000)
    p.add_argument("--eval-stories", type=int, default=400)
    p.add_argument("--placement", choices=("streamed", "auto"), default="streamed")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, few steps, little data")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.seq, args.warmup, args.log_every, args.eval_every = 4, 32, 1, 1, 2
        args.train_stories, args.eval_stories = 60, 10
        args.steps = min(args.steps, 4)
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    if len(seeds) < 3 and not args.tiny:
        p.error("the study needs >= 3 seeds")
    if set(systems) != set(SYSTEMS):
        p.error(f"--systems must list all of {SYSTEMS} (the summary compares them)")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from hf_megatrain.hf.default_job import load_tokenizer

    os.makedirs(args.out, exist_ok=True)
    tok = load_tokenizer()
    tok.model_max_length = 10 ** 9  # packing joins stories; blocks are cut to --seq below
    train = Rows(blocks(tok, args.train_stories, seed=100, seq=args.seq))
    evald = Rows(blocks(tok, args.eval_stories, seed=101, seq=args.seq))
    need = args.steps * args.batch
    if len(train) < need:
        print(f"note: {len(train)} train blocks < {need} needed: the data repeats "
              f"({math.ceil(need / len(train))} epochs)", flush=True)
    head = schema.header(__file__, argv)  # (the date: the study's start)
    t0 = time.perf_counter()
    runs = []
    params = 0
    for seed in seeds:
        base = build_model(tok, seed, args.tiny)
        params = sum(p.numel() for p in base.parameters())
        for system in systems:
            rec = train_one(system, copy.deepcopy(base), train, evald, seed, args, args.out)
            runs.append(rec)
            print(f"seed {seed} {system}: final eval loss {rec['final_eval_loss']:.4f} ({rec['wall_s']:.1f} s)",
                  flush=True)
    result = {**head,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "params": params, "train_blocks": len(train), "eval_blocks": len(evald),
              "args": {**vars(args), "seeds": seeds}, "wall_s": time.perf_counter() - t0, "runs": runs}
    result["summary"] = summarize(runs, seeds)
    md = markdown(result)
    schema.write(os.path.join(args.out, "precision_study.json"), result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
