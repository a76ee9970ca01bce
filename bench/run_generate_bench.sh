#!/usr/bin/env bash
# Greedy generation with and without a KV cache, fsdpp (bench/generate_bench.cpp) beside
# transformers' generate (bench/generate_peer.py) on a model of the same shape (dense, hidden 256,
# 4 layers, 8 heads, 2 KV heads, FFN 704, vocabulary 256; random weights), prompts of 16 to 2,048
# tokens, 32 new tokens. Each measurement a fresh process; rounds alternate the sides and the order.
# Writes bench/results/generate.md. Runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_generate_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-6}
out=bench/results/generate.md
source bench/preamble.sh
for r in $(seq 1 "$rounds"); do
  for prompt in 16 128 512 2048; do
    for cache in 1 0; do
      if [ $((r % 2)) = 1 ]; then order="fsdpp transformers"; else order="transformers fsdpp"; fi
      for side in $order; do
        if [ "$side" = fsdpp ]; then
          "$build/bench/fsdpp_generate_bench" --prompt "$prompt" --cache "$cache"
        else
          "$python" bench/generate_peer.py --prompt "$prompt" --cache "$cache"
        fi | sed -n "s/^RESULT generate /side=$side round=$r /p" >> "$work/results.txt"
      done
    done
  done
done
"$python" - "$work/results.txt" "$rounds" "$cpu" > "$out.tmp" <<'PY'
import collections, datetime, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = dict(kv.split("=") for kv in line.split())
    rows[(int(f["prompt"]), f["cache"], f["side"])].append((float(f["first_ms"]), float(f["per_token_ms"])))
print("# Generation: the KV cache, fsdpp beside transformers\n")
print(f"`bash bench/run_generate_bench.sh` ({sys.argv[2]} interleaved rounds; {datetime.date.today()}; {sys.argv[3]}).\n")
print("Greedy decoding of 32 new tokens after a prompt of random letters, batch 1, a random dense model of "
      "transformers' Llama shape (hidden 256, 4 layers, 8 heads, 2 KV heads, FFN 704, vocabulary 256): "
      "fsdpp's `train::generate` and transformers' `generate(do_sample=False)`, each with and without its "
      "cache, one fresh process per measurement, both on LibTorch's CPU kernels with its default threads. "
      "Per new token: the time of 33 new tokens less that of the first (each the fastest of 3 calls), over 32; "
      "median over rounds (min-max) in ms. "
      "tokens/s = 1000 / that.\n")
print("| prompt | fsdpp cached | fsdpp uncached | transformers cached | transformers uncached | fsdpp cached tokens/s | fsdpp / transformers (cached) |")
print("|---|---|---|---|---|---|---|")
def cell(v):
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
for prompt in sorted({k[0] for k in rows}):
    per = {(c, s): [x[1] for x in rows[(prompt, c, s)]] for c in "10" for s in ("fsdpp", "transformers")}
    ratio = [t / f for f, t in zip(per[("1", "fsdpp")], per[("1", "transformers")])]
    print(f"| {prompt} | {cell(per[('1', 'fsdpp')])} | {cell(per[('0', 'fsdpp')])} | {cell(per[('1', 'transformers')])} | "
          f"{cell(per[('0', 'transformers')])} | {1000 / statistics.median(per[('1', 'fsdpp')]):.0f} | "
          f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) |")
PY
mv "$out.tmp" "$out"
cat "$out"
