"""Tokens per second of an `fsdpp run` between two logged steps, from its metrics file:
    metrics_tokens_per_s.py RUN_DIR/metrics/rank0.jsonl FROM_STEP TO_STEP TOKENS_PER_STEP
Prints the rate and the loss logged at TO_STEP."""
import json
import sys

path, a, b, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = {r["step"]: r for r in map(json.loads, open(path)) if "time_s" in r}
print(tokens * (b - a) / (rows[b]["time_s"] - rows[a]["time_s"]), rows[b]["loss"])
