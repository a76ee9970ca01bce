#!/usr/bin/env bash
# Activation checkpointing on the small model at sequence length 512: none, every 2nd block and
# every block, rounds alternating. One process (dp=1, so the peak RSS is one rank's), moe-small's
# model with max_seq_len 512, 32 sequences of 512 bytes per step in 2 microbatches of 16.
# Peak RSS from /usr/bin/time; tokens/s over steps 2-8; the loss at step 8 (which must agree).
# Writes bench/results/activation_checkpointing.md.
#   bash bench/run_checkpointing_bench.sh [build-dir] [rounds]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-2}
out=bench/results/activation_checkpointing.md
for r in $(seq "$rounds"); do
  for ac in none 2 full; do
    d=$work/$ac-$r
    /usr/bin/time -f "%M" -o "$d.rss" "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 \
      model.max_seq_len=512 data.seq_len=512 train.global_batch=32 train.grad_accum=2 \
      train.activation_checkpointing=$ac eval.interval=0 eval.batches=1 checkpoint.enabled=false \
      logging.interval=1 logging.plot=false logging.output_dir="$d" --stop-after 8 > "$d.log" 2>&1 \
      || { cat "$d.log"; exit 1; }
    echo "$ac $(cat "$d.rss") $("$python" bench/metrics_tokens_per_s.py "$d/metrics/rank0.jsonl" 2 8 $((32 * 512)))"
  done
done > "$work/results.txt"
"$python" - "$work/results.txt" "$build" "$rounds" > "$out.tmp" <<'PY'
import datetime, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
names = {"none": "none", "2": "every 2nd block (layers 0, 2)", "full": "every block"}
print("# Activation checkpointing: memory and speed")
print()
print(f"Command: `bash bench/run_checkpointing_bench.sh {sys.argv[2]} {sys.argv[3]}` ({datetime.date.today()}), 2 cores,")
print("OPENBLAS_* as set by the machine. moe-small's model (4 layers, dim 128, 4 experts top-2) with")
print("max_seq_len 512; one process (dp=1); 32 sequences of 512 bytes per step, 2 microbatches of 16.")
print("Peak RSS of the process (includes LibTorch and the model: the differences are activations);")
print("tokens/s over steps 2-8; rounds alternate.")
print()
print("| train.activation_checkpointing | peak RSS (MiB, median) | tokens/s (median) | rounds (tokens/s) | loss at step 8 |")
print("|---|---:|---:|---|---|")
med = {}
for k in ("none", "2", "full"):
    rss = [int(a) / 1024 for kk, a, _, _ in rows if kk == k]
    tps = [float(t) for kk, _, t, _ in rows if kk == k]
    loss = sorted({l for kk, _, _, l in rows if kk == k})
    med[k] = (statistics.median(rss), statistics.median(tps))
    print(f"| {names[k]} | {med[k][0]:.0f} | {med[k][1]:.0f} | {' '.join(f'{x:.0f}' for x in tps)} | {', '.join(loss)} |")
print()
saved = med["none"][0] - med["full"][0]
print(f"Every block: {saved:.0f} MiB less peak memory ({100 * saved / med['none'][0]:.0f}% of the process), at "
      f"{med['full'][1] / med['none'][1]:.2f}x the tokens/s (one extra forward per block).")
PY
mv "$out.tmp" "$out"
cat "$out"
