#!/usr/bin/env bash
# The attention core of two builds side by side: bench/attention_bench.cpp (moe-small's shape,
# forward and backward) with each build's libfsdpp.so in turn, round after round (which goes first
# alternating), at one thread, as a microbatch thread runs it. Reports the `one-pass` way (the
# model's attention: models::rotary_causal_attention) and `fused` (models::rotary_qkv, then
# models::causal_attention): each round's median of 10 steps, medians over rounds and the median of
# the rounds' ratios.
#   bash bench/run_attention_ab.sh NAME [rounds] before=dir after=dir
# Each dir holds a build's libfsdpp.so and libfsdpp_gloo.so (copied from its tree); the attention
# bench of the build folder FSDPP_BUILD (default build) runs both, loading each dir's libraries
# through LD_LIBRARY_PATH. Runs with the machine's OPENBLAS_* settings as they are; writes
# bench/results/NAME.md.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/run_attention_ab.sh NAME [rounds] before=dir after=dir"
source bench/ab_builds.sh
ab_builds "$usage" 10 "$@"
[[ ${#extra[@]} -eq 0 ]] || { echo "$usage"; exit 1; }
build=${FSDPP_BUILD:-build}
bench=$build/bench/fsdpp_attention_bench
[[ -x $bench ]] || { echo "$bench: not built (ninja -C $build bench/fsdpp_attention_bench)"; exit 1; }
source bench/preamble.sh
out=bench/results/$name.md
results=$work/results.txt
: > "$results"
for ((r = 0; r < rounds; r++)); do
  echo "round $((r + 1)) of $rounds"
  for k in 0 1; do
    i=$(((r + k) % 2))
    LD_LIBRARY_PATH=${dirs[$i]} "$bench" --threads 1 --rounds 1 |
      sed -n "s/^RESULT attention way=\(one-pass\|fused\) .* fwd_bwd_ms=\([0-9.]*\) .*/$r ${labels[$i]} \1 \2/p" >> "$results"
  done
done
"$python" - "$results" "$name" "$rounds" "$cpu" "${labels[0]}=${dirs[0]}" "${labels[1]}=${dirs[1]}" > "$out.tmp" <<'PY'
import datetime, statistics, sys
path, name, rounds, cpu, a, b = sys.argv[1:]
la, lb = a.split("=")[0], b.split("=")[0]
ms = {}
for line in open(path):
    r, label, way, t = line.split()
    ms.setdefault((way, label), {})[int(r)] = float(t)
print(f"# The attention core of two builds side by side: {la} and {lb}")
print()
print(f"Command: `bash bench/run_attention_ab.sh {name} {rounds} {a} {b}` ({datetime.date.today()}), {cpu}, "
      "OPENBLAS_* as set by the machine.")
print()
print("`bench/attention_bench.cpp` at moe-small's shape (16 sequences of 128 tokens, 4 heads of 32), forward")
print("and backward, one thread, with each build's libraries in turn (which goes first alternating); each")
print("round's figure the median of 10 steps; medians over rounds, and the median of the rounds' ratios.")
print("`one-pass` is the model's attention (`models::rotary_causal_attention`), `fused` the rotary and")
print("the attention kernel as two calls.")
print()
print(f"| way | build | fwd+bwd ms (median) | {la} over {lb} (time) | rounds (ms) |")
print("|---|---|---:|---:|---|")
for way in ("one-pass", "fused"):
    x, y = ms[way, la], ms[way, lb]
    ratios = [x[r] / y[r] for r in sorted(x) if r in y]
    for label, d in ((la, x), (lb, y)):
        ratio = (f"**{statistics.median(ratios):.3f}x** ({sum(q > 1 for q in ratios)} of {len(ratios)} faster)"
                 if label == lb else "")
        print(f"| {way} | {label} | {statistics.median(d.values()):.2f} | {ratio} | "
              f"{' '.join(f'{d[r]:.2f}' for r in sorted(d))} |")
PY
mv "$out.tmp" "$out"
cat "$out"
