"""Pick, inside one device queue, the MegaTrainConfig overrides whose N-process bench ran fastest.

    python3 integration/probes/pick_config.py DIR=JSON [DIR=JSON ...] > best.json

Each argument is a bench output folder (``bench_vs_deepspeed.py --out DIR``) and the ``--megatrain-config`` it ran
with. The score is the sum over the batch sizes of the multi-process step time (every candidate must have run the
same sizes and process counts); the winner's JSON goes to stdout, the table to stderr. A later queue line reads it
(``--megatrain-config "$(cat best.json)"``), so the runs after a comparison use the winner without a second call.
A candidate with a missing or failed record loses; with none usable, the first candidate (the defaults) is printed.
"""
from __future__ import annotations

import glob
import json
import os
import sys


def multi_process_times(folder: str) -> dict[str, float]:
    """``{record key: step seconds}`` for the records of more than one process that finished."""
    times: dict[str, float] = {}
    for path in glob.glob(os.path.join(folder, "bench_vs_deepspeed_*.json")):
        with open(path) as f:
            records = json.load(f).get("records", {})
        for key, rec in records.items():
            if rec.get("status") == "ok" and (rec.get("processes") or 1) > 1 and rec.get("step_time_s"):
                times[key] = float(rec["step_time_s"])
    return times


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    candidates = []
    for arg in argv:
        folder, _, config = arg.partition("=")
        candidates.append((folder, config or "{}", multi_process_times(folder)))
    keys = set().union(*(t for _, _, t in candidates))
    best, best_score = candidates[0][1], float("inf")
    for folder, config, times in candidates:
        score = sum(times[k] for k in keys) if keys and keys <= set(times) else float("inf")
        print(f"{config:50s} {score:8.3f} s  {json.dumps(times, sort_keys=True)}  ({folder})", file=sys.stderr)
        if score < best_score:
            best, best_score = config, score
    json.loads(best)  # a malformed candidate fails here, not in the later queue line
    print(best)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
