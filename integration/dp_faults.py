"""Data-parallel faults on the GPUs (issue 45, part 5): a rank killed or out of memory mid-step, NCCL collectives.

Each scenario starts 2 ranks as plain processes (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` env, one GPU each, NCCL
for the gradients): a launcher that, unlike torchrun's agent, never ends the other ranks. A small Llama (built in
code) trains with ``MegaTrainEngine(dp=...)``; at step 3 rank 1, between its backward and its step, SIGKILLs itself
(``kill``) or raises ``torch.cuda.OutOfMemoryError`` (``oom``); rank 0 goes on into the step's NCCL all-reduce, which
would wait for rank 1 until NCCL's timeout. Recorded per scenario: each rank's exit code, how long after rank 1's end
rank 0 ended, whether rank 0's log names rank 1, what is left in the run's ``shared_memory_dir`` and which processes
still hold a GPU.

    python integration/dp_faults.py --out $OUT --commit <hash>     # a host with >= 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

STEPS, FAULT_STEP = 6, 3


def child(fault: str, shm: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_megatrain import MegaTrainConfig, MegaTrainEngine
    from hf_megatrain.parallel import DataParallel

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                         num_attention_heads=8, num_key_value_heads=2, vocab_size=4096))
    engine = MegaTrainEngine(model, MegaTrainConfig(shared_memory_dir=shm), dp=DataParallel.from_process_group())
    opt = engine.create_optimizer(lr=1e-4, max_grad_norm=1.0)
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, 4096, (2, 512), device="cuda")
        engine(input_ids=ids, labels=ids).loss.backward()
        if rank == 1 and step == FAULT_STEP:
            print(f"rank 1: fault {fault} at {time.time():.3f}", flush=True)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated by integration/dp_faults.py)")
        opt.step()
        opt.zero_grad()
        print(f"rank {rank}: step {step} done", flush=True)


def _gpu_holders() -> list[str]:
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if line.strip()]


def scenario(fault: str, out: str) -> dict:
    shm = f"/dev/shm/dp_faults_{os.getpid()}_{fault}"
    os.makedirs(shm)
    port = 29000 + os.getpid() % 1000
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        log = open(os.path.join(out, f"{fault}_rank{rank}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", fault, "--shm", shm], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 420
    while len(ended) < 2 and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.monotonic()
        time.sleep(0.05)
    hung = [r for r in range(2) if r not in ended]
    for r in hung:  # (what the liveness watch is there to prevent)
        procs[r].kill()
        procs[r].wait()
        ended[r] = time.monotonic()
    for log in logs:
        log.close()
    text = open(os.path.join(out, f"{fault}_rank0.log")).read()
    named = re.search(r"hf_megatrain data parallel: rank 1 \(pid \d+\) [^\n]*", text)
    time.sleep(2)
    return dict(fault=fault, codes=[p.returncode for p in procs], hung=hung,
                rank0_after_rank1_s=round(ended[0] - ended[1], 2), rank0_names_rank1=bool(named),
                rank0_line=named.group(0)[:400] if named else None,
                shm_left=os.listdir(shm), gpu_holders_after=_gpu_holders())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--shm")
    ap.add_argument("--out", default="/tmp/dp_faults")
    ap.add_argument("--commit", help="the tree's commit (the GPU machine's copy may carry a stale .git)")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.shm)
    import torch

    from bench import record as schema

    os.makedirs(a.out, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    record = dict(what="data-parallel faults: 2 plain processes (no agent), NCCL, rank 1 killed / OOM mid-step",
                  **schema.header(__file__, given_commit=a.commit),
                  scenarios=[scenario(f, a.out) for f in ("kill", "oom")])
    name = f"dp_faults_{gpu.replace(' ', '_').lower()}"
    schema.write(os.path.join(a.out, name + ".json"), record)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
