#!/usr/bin/env bash
# Real data at scale: how fast `fsdpp tokenize` turns text into shards, and whether training over
# token shards depends on the corpus's size.
#
#  1. Tokenize: fortunes repeated to about 26 MB of text, the bundled BPE (2048 pieces) on 1 and 2
#     threads, and the bytes tokenizer; MB/s as `fsdpp tokenize` reports it. Rounds alternate.
#  2. Train over generated llm.c shards of 0.5, 2 and 8 GB (uniform random uint16 tokens below 2048,
#     100 M tokens per shard, numpy): moe-small's model with vocab 2048, one process (dp=1),
#     32 sequences of 128 tokens per step, 40 steps. Peak RSS of the process (summary.json's
#     peak_rss_mib: getrusage, which counts mapped file pages too) and tokens/s over steps 2-40.
#     Sizes alternate within each round.
#  3. Bytes against BPE: moe-small and moe-small-bpe (the same model but for the embedding and head,
#     2 ranks) for the first 300 of their 1000 steps; validation loss in bits per byte.
# Writes bench/results/data.md. Needs about 11 GB of free disk under $TMPDIR (default /tmp).
#   bash bench/run_data_bench.sh [build-dir] [rounds]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-2}
out=bench/results/data.md
tok=recipes/tokenizers/fortunes-bpe-2048.model

# ---- 1. tokenize throughput
mkdir -p "$work/text"
"$python" - "$work/text" <<'PY'
import os, sys
src = "/usr/share/games/fortunes"
text = b"".join(open(os.path.join(src, f), "rb").read() for f in sorted(os.listdir(src))
                if "." not in f and os.path.isfile(os.path.join(src, f)) and not os.path.islink(os.path.join(src, f)))
for i in range(10):
    open(os.path.join(sys.argv[1], f"part{i:02d}.txt"), "wb").write(text)
PY
for r in $(seq "$rounds"); do
  for mode in bpe-1 bpe-2 bytes; do
    case $mode in
      bpe-1) args=(--tokenizer "$tok" --threads 1) ;;
      bpe-2) args=(--tokenizer "$tok" --threads 2) ;;
      bytes) args=(--tokenizer bytes) ;;
    esac
    "$build/fsdpp" tokenize "${args[@]}" "$work/text" -o "$work/tok-$mode" > "$work/tok.log"
    # "... MB in 7.9 s (3.31 MB/s), 2.540 bytes/token"
    echo "$mode $(grep -o '([0-9.]* MB/s)' "$work/tok.log" | tr -d '(' | cut -d' ' -f1) $(grep -o '[0-9.]* bytes/token' "$work/tok.log" | cut -d' ' -f1)"
  done
done > "$work/tokenize.txt"
rm -rf "$work"/tok-*

# ---- 2. training over shards of three sizes
for gb in 0.5 2 8; do
  "$python" - "$work/shards-$gb" "$gb" <<'PY'
import os, sys
import numpy as np
d, gb = sys.argv[1], float(sys.argv[2])
os.makedirs(d)
rng = np.random.default_rng(0)
def shard(path, n):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, n
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for at in range(0, n, 10_000_000):
            f.write(rng.integers(0, 2048, min(10_000_000, n - at), dtype=np.uint16).tobytes())
shard(f"{d}/gen_val_000000.bin", 1_000_000)
left, i = int(gb * 1e9 / 2), 1
while left > 0:
    n = min(left, 100_000_000)
    shard(f"{d}/gen_train_{i:06d}.bin", n)
    left, i = left - n, i + 1
PY
done
for r in $(seq "$rounds"); do
  for gb in 0.5 2 8; do
    d=$work/run-$gb-$r
    "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 model.vocab_size=2048 data.source=shards \
      data.path="$work/shards-$gb" data.tokenizer=none train.global_batch=32 train.grad_accum=1 \
      eval.interval=0 eval.batches=1 checkpoint.enabled=false logging.interval=1 logging.plot=false \
      logging.output_dir="$d" --stop-after 40 > "$d.log" 2>&1 || { cat "$d.log"; exit 1; }
    echo "$gb $(du -sb "$work/shards-$gb" | cut -f1) $("$python" -c "import json,sys; print(json.load(open(sys.argv[1]))['peak_rss_mib'])" "$d/summary.json") $("$python" bench/metrics_tokens_per_s.py "$d/metrics/rank0.jsonl" 2 40 $((32 * 128)))"
  done
done > "$work/train.txt"

# ---- 3. bytes against BPE
for recipe in moe-small moe-small-bpe; do
  d=$work/$recipe
  "$build/fsdpp" run recipes/$recipe.json checkpoint.enabled=false logging.plot=false logging.output_dir="$d" \
    --stop-after 300 > "$d.log" 2>&1 || { cat "$d.log"; exit 1; }
  echo "$recipe $("$python" -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['val_loss'], s['val_bpb'], s['tokens_per_s'])" "$d/summary.json")"
done > "$work/bpe.txt"

"$python" - "$work/tokenize.txt" "$work/train.txt" "$build" "$rounds" "$work/bpe.txt" > "$out.tmp" <<'PY'
import datetime, statistics, sys
tok = [l.split() for l in open(sys.argv[1])]
train = [l.split() for l in open(sys.argv[2])]
bpe = [l.split() for l in open(sys.argv[5])]
print("# Real data: tokenize throughput, and training over token shards of growing size")
print()
print(f"Command: `bash bench/run_data_bench.sh {sys.argv[3]} {sys.argv[4]}` ({datetime.date.today()}), 2 cores, 23 GB of RAM,")
print("OPENBLAS_* as set by the machine. Rounds alternate.")
print()
print("## `fsdpp tokenize`")
print()
print("Input: the fortunes corpus repeated to 25.8 MB of text in 10 files. MB/s as the command reports it")
print("(reading, encoding, writing and syncing the shards).")
print()
print("| tokenizer | threads | MB/s (median) | rounds | bytes/token |")
print("|---|---:|---:|---|---:|")
names = {"bpe-1": ("fortunes-bpe-2048 (BPE)", 1), "bpe-2": ("fortunes-bpe-2048 (BPE)", 2), "bytes": ("bytes", 2)}
med = {}
for k, (name, threads) in names.items():
    v = [float(a) for kk, a, _ in tok if kk == k]
    bpt = {b for kk, _, b in tok if kk == k}
    med[k] = statistics.median(v)
    print(f"| {name} | {threads} | {med[k]:.2f} | {' '.join(f'{x:.2f}' for x in v)} | {', '.join(sorted(bpt))} |")
print()
print(f"Two threads: {med['bpe-2'] / med['bpe-1']:.2f}x one thread for BPE.")
print()
print("## Training over token shards")
print()
print("Generated llm.c shards (uniform random tokens below 2048, 100 M tokens per file); moe-small's")
print("model with vocabulary 2048, one process (dp=1), 32 sequences of 128 tokens per step, 40 steps,")
print("`data.tokenizer=none`. Peak RSS: summary.json's `peak_rss_mib` (getrusage; mapped file pages")
print("count while resident). Tokens/s over steps 2-40. The shards had just been written, so the kernel's")
print("page cache held much of them; the reader maps each file and hands its pages back after each copy.")
print()
print("| corpus | shard bytes | peak RSS (MiB, median) | tokens/s (median) | rounds (tokens/s) |")
print("|---|---:|---:|---:|---|")
rows = {}
for gb in ("0.5", "2", "8"):
    sel = [r for r in train if r[0] == gb]
    rss = [float(r[2]) for r in sel]
    tps = [float(r[3]) for r in sel]
    rows[gb] = (statistics.median(rss), statistics.median(tps))
    print(f"| {gb} GB | {int(sel[0][1]):,} | {rows[gb][0]:.0f} | {rows[gb][1]:.0f} | {' '.join(f'{x:.0f}' for x in tps)} |")
print()
print(f"8 GB against 0.5 GB: peak RSS {rows['8'][0] - rows['0.5'][0]:+.0f} MiB ({rows['8'][0] / rows['0.5'][0]:.3f}x), "
      f"tokens/s {rows['8'][1] / rows['0.5'][1]:.3f}x.")
print()
print("## Bytes against BPE on fortunes")
print()
print("`recipes/moe-small.json` (bytes) and `recipes/moe-small-bpe.json` (fortunes-bpe-2048), each stopped after")
print("300 of its 1000 steps (the learning-rate schedule is the 1000-step one), 2 ranks, 32 sequences of 128")
print("tokens per step: the BPE run sees about 2.5x the text per step. Validation on each run's own")
print("held-out fortunes (the same documents: the split depends on the seed only), 8 batches.")
print()
print("| recipe | validation loss (nats/token) | bits per byte | tokens/s |")
print("|---|---:|---:|---:|")
for name, loss, bpb, tps in bpe:
    print(f"| {name} | {float(loss):.4f} | {float(bpb):.4f} | {float(tps):.0f} |")
PY
mv "$out.tmp" "$out"
cat "$out"
