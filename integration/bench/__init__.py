"""Side-by-side benchmark of hf_megatrain vs DeepSpeed ZeRO-3 offload vs FSDP2 CPU offload vs plain GPU training
(one system per process).

Entry point: ``integration/bench_vs_deepspeed.py``. Each ``run_<system>.py`` here runs ONE system at ONE batch
size from a JSON spec and writes one JSON record; ``common.py`` holds what all of them must share (model, data,
timing, metrics) so the comparison is like for like. The other scripts of integration/ are entries on the same
pieces: ``child.py`` runs one point in its own process (``run_attempts``: the retries smaller on out-of-memory,
within the call's time budget), ``record.py`` is the header every result file carries (command, commit, date,
machine, versions) and its writer.
"""
