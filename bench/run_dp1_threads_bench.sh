#!/usr/bin/env bash
# fsdpp run at dp 1 on the machine's cores: a step's microbatches one after the other, every operator
# on all intra-op threads (parallel.microbatch_threads=1, the default), against
# parallel.microbatch_threads=2 (both at once, one thread each; recipe.hpp says how), on moe-small's
# recipe (2 microbatches of 16 x 128 tokens a step). Rounds alternate which goes first; tokens/s over
# the steps after the warm-up, from each run's metrics; peak memory from its summary. Runs with the
# machine's OPENBLAS_* settings as they are; writes bench/results/dp1_threads.md, or the file given third.
#   bash bench/run_dp1_threads_bench.sh [build-dir] [rounds] [output]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-10}
out=${3:-bench/results/dp1_threads.md}
python=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python
source bench/cpuinfo.sh
cpu=$(cpuinfo 'model name')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
warmup=5
steps=40
results=$work/results.txt
: > "$results"

run() {
  local threads=$1 dir=$work/run
  rm -rf "$dir"
  "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 parallel.microbatch_threads=$threads eval.interval=0 \
    checkpoint.interval=0 logging.interval=$warmup logging.plot=false logging.output_dir="$dir" \
    --overwrite --stop-after $((warmup + steps)) > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  read -r tps loss < <("$python" bench/metrics_tokens_per_s.py "$dir/metrics/rank0.jsonl" $warmup $((warmup + steps)) $((32 * 128)))
  local rss
  rss=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["peak_rss_mib"])' "$dir/summary.json")
  echo "$threads $tps $loss $rss" >> "$results"
}

for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  if ((round % 2)); then run 1; run 2; else run 2; run 1; fi
done

"$python" - "$results" "$build" "$rounds" "$cpu" "$warmup" "$steps" "${3:-}" > "$out.tmp" <<'PY'
import datetime, statistics, sys
from collections import defaultdict
path, build, rounds, cpu, warmup, steps, extra = sys.argv[1:8]
tps, loss, rss = defaultdict(list), defaultdict(list), defaultdict(list)
for line in open(path):
    t, a, b, c = line.split()
    tps[t].append(float(a)); loss[t].append(float(b)); rss[t].append(float(c))
extra = f" {extra}" if extra else ""
print("# fsdpp run at dp 1: a step's microbatches one after the other, or at once on threads of their own")
print()
print(f"Command: `bash bench/run_dp1_threads_bench.sh {build} {rounds}{extra}` ({datetime.date.today()}), 2 cores of {cpu}, "
      "OPENBLAS_* as set by the machine.")
print()
print("`fsdpp run recipes/moe-small.json parallel.dp=1` (2 microbatches of 16 x 128 tokens a step) with")
print("`parallel.microbatch_threads=1` (the default: one microbatch after the other, every operator on the")
print("process's 2 intra-op threads) and `=2` (both at once, one on each of two threads, every operator on")
print(f"one thread). Tokens/s over steps {int(warmup) + 1} to {int(warmup) + int(steps)}, from the run's metrics; rounds alternate which runs first.")
print()
print("| microbatch_threads | tokens/s (median) | peak memory (MiB, median) | loss at the last step | rounds (tokens/s) |")
print("|---:|---:|---:|---:|---|")
for t in sorted(tps):
    print(f"| {t} | {statistics.median(tps[t]):.0f} | {statistics.median(rss[t]):.0f} | {loss[t][0]:.6f} | "
          f"{' '.join(f'{x:.0f}' for x in tps[t])} |")
ratios = [b / a for a, b in zip(tps["1"], tps["2"])]
print()
print(f"microbatch_threads=2 over 1, round by round: **{statistics.median(ratios):.3f}x** (median; "
      f"{min(ratios):.3f}x to {max(ratios):.3f}x, {sum(r > 1 for r in ratios)} of {len(ratios)} rounds above 1).")
same = all(abs(x - loss["1"][0]) <= 1e-4 * abs(loss["1"][0]) for x in loss["1"] + loss["2"])
print(f"The last step's loss agrees across every run within 1e-4: {'yes' if same else 'no'}.")
PY
mv "$out.tmp" "$out"
cat "$out"
