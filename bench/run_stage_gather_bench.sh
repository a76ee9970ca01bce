#!/usr/bin/env bash
# FSDP stages kept gathered across their microbatches or not: `recipes/moe-small-2d.json` (dp=2 x
# pp=2, 1F1B, 2 microbatches) with parallel.keep_stages_unsharded true and false, rounds
# alternating; tokens/s over steps 6-25 and the final loss (which must be equal). Writes
# bench/results/pipeline_fsdp.md.   bash bench/run_stage_gather_bench.sh [build-dir] [rounds]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-3}
out=bench/results/pipeline_fsdp.md
for r in $(seq "$rounds"); do
  for keep in true false; do
    d=$work/$keep-$r
    "$build/fsdpp" run recipes/moe-small-2d.json parallel.keep_stages_unsharded=$keep eval.interval=0 \
      checkpoint.interval=0 logging.interval=5 logging.plot=false logging.output_dir="$d" --overwrite \
      --stop-after 25 > "$d.log" 2>&1 || { cat "$d.log"; exit 1; }
    echo "$keep $("$python" bench/metrics_tokens_per_s.py "$d/metrics/rank0.jsonl" 5 25 $((32 * 128)))"
  done
done > "$work/results.txt"
"$python" - "$work/results.txt" "$build" "$rounds" > "$out.tmp" <<'PY'
import datetime, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
tps = {k: [float(t) for kk, t, _ in rows if kk == k] for k in ("true", "false")}
loss = {k: {l for kk, _, l in rows if kk == k} for k in ("true", "false")}
print("# FSDP stages: gathered once per step, or per microbatch")
print()
print(f"Command: `bash bench/run_stage_gather_bench.sh {sys.argv[2]} {sys.argv[3]}` ({datetime.date.today()}), 2 cores,")
print("OPENBLAS_* as set by the machine. `recipes/moe-small-2d.json`: dp=2 x pp=2, 1F1B, 2 microbatches per")
print("step, each stage a root over 2 fully_shard blocks. Tokens/s over steps 6-25; rounds alternate.")
print()
print("| parallel.keep_stages_unsharded | tokens/s (median) | rounds | loss at step 25 |")
print("|---|---:|---|---|")
for k in ("true", "false"):
    print(f"| {k} | {statistics.median(tps[k]):.0f} | {' '.join(f'{x:.0f}' for x in tps[k])} | {', '.join(sorted(loss[k]))} |")
print()
print(f"Ratio true / false: **{statistics.median(tps['true']) / statistics.median(tps['false']):.2f}x**; the losses are "
      f"{'bitwise equal' if loss['true'] == loss['false'] else 'DIFFERENT'}. Per rank and step, the executor test counts 3")
print("all-gathers kept against 15 regathered (1F1B, 4 microbatches, two blocks per stage).")
PY
mv "$out.tmp" "$out"
cat "$out"
