#!/usr/bin/env bash
# Training speed of two builds side by side: `fsdpp run recipes/moe-small.json` with each build's
# libraries in turn, round after round (which goes first alternating), so that a busy spell on a
# shared machine falls on both. Tokens/s over the steps after the warm-up, from each run's metrics,
# and the loss logged at the last step (the same for both where the change keeps the bits). Each
# CONFIG is one set of overrides for `fsdpp run`, space-separated in one argument (e.g.
# "parallel.dp=1 cpu.microbatch_threads=2"; "" for the recipe as it is); each round runs
# every one.
#   bash bench/run_build_ab.sh NAME [rounds] before=dir after=dir CONFIG [CONFIG ...]
# Each dir holds a build's libfsdpp.so and libfsdpp_gloo.so (copied from its tree); the fsdpp CLI of
# the build folder FSDPP_BUILD (default build) runs both, loading each dir's libraries through
# LD_LIBRARY_PATH.
# Runs with the machine's OPENBLAS_* settings as they are; writes bench/results/NAME.md.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/run_build_ab.sh NAME [rounds] before=dir after=dir CONFIG [CONFIG ...]"
source bench/ab_builds.sh
ab_builds "$usage" 6 "$@"
[[ ${#extra[@]} -ge 1 ]] || { echo "$usage"; exit 1; }
configs=("${extra[@]}")
build=${FSDPP_BUILD:-build}
source bench/preamble.sh
out=bench/results/$name.md
warmup=10
steps=40
results=$work/results.txt
: > "$results"

run() {
  local c=$1 i=$2 dir=$work/run
  local overrides
  read -r -a overrides <<< "${configs[$c]}"
  rm -rf "$dir"
  LD_LIBRARY_PATH=${dirs[$i]} "$fsdpp" run recipes/moe-small.json "${overrides[@]}" eval.interval=0 checkpoint.interval=0 \
    logging.interval=5 logging.plot=false logging.output_dir="$dir" --overwrite --stop-after $((warmup + steps)) \
    > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  local tokens
  tokens=$("$python" -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["train"]["global_batch"] * r["data"]["seq_len"])' "$dir/recipe.json")
  read -r tps loss < <("$python" bench/metrics_tokens_per_s.py "$dir/metrics/rank0.jsonl" $warmup $((warmup + steps)) "$tokens")
  echo "$c ${labels[$i]} $tps $loss" >> "$results"
}

for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  for c in "${!configs[@]}"; do
    if ((round % 2)); then run "$c" 0; run "$c" 1; else run "$c" 1; run "$c" 0; fi
  done
done

"$python" - "$results" "$name" "$rounds" "$cpu" "${labels[0]}=${dirs[0]}" "${labels[1]}=${dirs[1]}" "${configs[@]}" > "$out.tmp" <<'PY'
import datetime, shlex, statistics, sys
path, name, rounds, cpu, a, b, *configs = sys.argv[1:]
la, lb = a.split("=")[0], b.split("=")[0]
runs = {(c, label): [] for c in range(len(configs)) for label in (la, lb)}
for line in open(path):
    c, label, tps, loss = line.split()
    runs[int(c), label].append((float(tps), loss))
cmd = " ".join(["bash bench/run_build_ab.sh", name, rounds, a, b, *map(shlex.quote, configs)])
print(f"# Two builds side by side: {la} and {lb}")
print()
print(f"Command: `{cmd}` ({datetime.date.today()}), {cpu}, OPENBLAS_* as set by the machine.")
print()
print("`fsdpp run recipes/moe-small.json` with each build's libraries in turn (which goes first")
print("alternating), each configuration's pair in every round; tokens/s over steps 10-50 from the run's")
print("metrics, medians over rounds, and the median of the rounds' ratios.")
print()
print(f"| overrides | build | tokens/s (median) | loss at step 50 | {lb} over {la} | rounds (tokens/s) |")
print("|---|---|---:|---|---:|---|")
for c, config in enumerate(configs):
    ratios = [y[0] / x[0] for x, y in zip(runs[c, la], runs[c, lb])]
    for label in (la, lb):
        rows = runs[c, label]
        ratio = (f"**{statistics.median(ratios):.3f}** ({sum(r > 1 for r in ratios)} of {len(ratios)} faster)"
                 if label == lb else "")
        print(f"| {config or '(none)'} | {label} | {statistics.median(t for t, _ in rows):,.0f} | "
              f"{', '.join(sorted({loss for _, loss in rows}))} | {ratio} | {' '.join(f'{t:.0f}' for t, _ in rows)} |")
PY
mv "$out.tmp" "$out"
cat "$out"
