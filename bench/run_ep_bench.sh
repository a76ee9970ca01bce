#!/usr/bin/env bash
# Expert parallelism: tokens/s and per-rank parameter memory at ep = 1, 2 and 4, world 4 (dp 4),
# moe-small-ep's model (8 experts top-2, 4 layers of which 3 MoE), 32 sequences of 128 bytes per
# step in 2 microbatches per rank. Rounds alternate ep 1, 2, 4. Tokens/s over steps 3-12 from the
# metrics; parameter memory from summary.json; where rank 0's time goes from a traced run of each
# (--trace records steps 2-3). Four ranks on 2 cores: the figures show the exchange's cost
# relative to compute, not what ep gains where each rank has its own device.
# Writes bench/results/expert_parallel.md.
#   bash bench/run_ep_bench.sh [build-dir] [rounds]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-3}
out=bench/results/expert_parallel.md
common=(parallel.dp=4 eval.interval=0 eval.batches=1 checkpoint.enabled=false logging.interval=1 logging.plot=false)
for r in $(seq "$rounds"); do
  for ep in 1 2 4; do
    d=$work/ep$ep-$r
    "$build/fsdpp" run recipes/moe-small-ep.json "${common[@]}" parallel.ep=$ep logging.output_dir="$d" \
      --stop-after 12 > "$d.log" 2>&1 || { cat "$d.log"; exit 1; }
    echo "$ep $("$python" bench/metrics_tokens_per_s.py "$d/metrics/rank0.jsonl" 3 12 $((32 * 128)))"
  done
done > "$work/results.txt"
for ep in 1 2 4; do
  d=$work/trace-ep$ep
  "$build/fsdpp" run recipes/moe-small-ep.json "${common[@]}" parallel.ep=$ep logging.output_dir="$d" \
    --stop-after 4 --trace > "$d.log" 2>&1 || { cat "$d.log"; exit 1; }
done
"$python" - "$work" "$build" "$rounds" > "$out.tmp" <<'PY'
import collections, datetime, json, re, statistics, sys
work, build, rounds = sys.argv[1:]
rows = [l.split() for l in open(f"{work}/results.txt")]

def breakdown(path):
    """Rank 0's milliseconds per step: compute spans, and communication by kind (on its own threads)."""
    t = json.load(open(path))["traceEvents"]
    track = {(e["pid"], e["tid"]): e["args"]["name"] for e in t if e["ph"] == "M" and e["name"] == "thread_name"}
    steps = [e for e in t if e["ph"] == "X" and e["pid"] == 0 and track[(0, e["tid"])] == "steps"]
    total = collections.Counter()
    for e in t:
        if e["ph"] != "X" or e["pid"] != 0:
            continue
        tr, name = track[(0, e["tid"])], e["name"]
        if tr == "compute":
            total[name] += e["dur"]
        elif tr.startswith("comm"):
            if "moe all_to_all" in name:
                total["all-to-all (experts)"] += e["dur"]
            elif "all_gather" in name:
                total["all-gather"] += e["dur"]
            elif "reduce_scatter" in name:
                total["reduce-scatter"] += e["dur"]
            else:
                total["other collectives"] += e["dur"]
    n = max(1, len(steps))
    return {k: v / n / 1e3 for k, v in total.items()}, sum(e["dur"] for e in steps) / n / 1e3

print("# Expert parallelism: speed, parameter memory, where the time goes")
print()
print(f"Command: `bash bench/run_ep_bench.sh {build} {rounds}` ({datetime.date.today()}), 2 cores, OPENBLAS_* as set by")
print("the machine. `recipes/moe-small-ep.json` (8 experts top-2, dim 128, 4 layers, the first dense) at")
print("parallel.dp=4: four ranks on two cores, so compute and communication share the cores. 32")
print("sequences of 128 bytes per step, 2 microbatches per rank; tokens/s over steps 3-12; rounds")
print("alternate ep 1, 2, 4. Losses agree across ep (they are the same computation).")
print()
print("| ep | experts per rank | tokens/s (median) | rounds | loss at step 12 | sharded parameters per rank (MiB) | one MoE block gathered (MiB) | largest block gathered (MiB) |")
print("|---:|---:|---:|---|---|---:|---:|---:|")
med = {}
for ep in ("1", "2", "4"):
    tps = [float(t) for e, t, _ in rows if e == ep]
    loss = sorted({l for e, _, l in rows if e == ep})
    med[ep] = statistics.median(tps)
    mem = json.load(open(f"{work}/trace-ep{ep}/summary.json"))["parameter_mib"]
    print(f"| {ep} | {8 // int(ep)} | {med[ep]:.0f} | {' '.join(f'{x:.0f}' for x in tps)} | {', '.join(loss)} | "
          f"{mem['sharded']:.2f} | {mem['moe_block_gathered']:.2f} | {mem['largest_block_gathered']:.2f} |")
print()
print(f"tokens/s relative to ep 1: ep 2 {med['2'] / med['1']:.2f}x, ep 4 {med['4'] / med['1']:.2f}x.")
print()
print("Rank 0's milliseconds per step (traced steps 2-3 of a separate run of each; communication runs on")
print("its own threads, so it overlaps compute except where compute waits for it: the experts'")
print("all-to-alls are waited for at once, the all-gathers ahead of time):")
print()
kinds = ["forward", "backward", "clip", "optimizer", "all-gather", "reduce-scatter", "all-to-all (experts)", "other collectives"]
print("| ep | step | " + " | ".join(kinds) + " |")
print("|---:|---:|" + "---:|" * len(kinds))
for ep in ("1", "2", "4"):
    b, step = breakdown(f"{work}/trace-ep{ep}/trace.json")
    print(f"| {ep} | {step:.0f} | " + " | ".join(f"{b.get(k, 0):.1f}" for k in kinds) + " |")
PY
mv "$out.tmp" "$out"
cat "$out"
