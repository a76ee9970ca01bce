#!/usr/bin/env bash
# fsdpp run at dp 1 on the machine's cores: a step's microbatches one after the other, every operator
# on all intra-op threads (cpu.microbatch_threads=1, the default), against
# cpu.microbatch_threads=2 (both at once, one thread each; recipe.hpp says how), and the same
# with libgomp's own spin count (GOMP_SPINCOUNT=300000, which `fsdpp run` then leaves as it is, instead
# of the 10,000 it gives the ranks of such a run: fsdpp/base/openmp_wait.hpp), on moe-small's recipe
# (2 microbatches of 16 x 128 tokens a step). Rounds rotate which goes first; tokens/s over the steps
# after the warm-up, from each run's metrics; peak memory from its summary. Runs with the machine's
# OPENBLAS_* settings as they are; writes bench/results/dp1_threads.md, or the file given third.
#   bash bench/run_dp1_threads_bench.sh [build-dir] [rounds] [output]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-10}
out=${3:-bench/results/dp1_threads.md}
warmup=5
steps=40
results=$work/results.txt
: > "$results"

# way: label, microbatch_threads, GOMP_SPINCOUNT for `fsdpp run` ("-": unset)
ways=("1:1:-" "2:2:-" "2-own-spin:2:300000")
run() {
  local label threads spins dir=$work/run
  IFS=: read -r label threads spins <<< "$1"
  local env=(-u GOMP_SPINCOUNT -u OMP_WAIT_POLICY)
  if [[ $spins != - ]]; then env+=("GOMP_SPINCOUNT=$spins"); fi
  rm -rf "$dir"
  env "${env[@]}" "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 cpu.microbatch_threads=$threads eval.interval=0 \
    checkpoint.interval=0 logging.interval=$warmup logging.plot=false logging.output_dir="$dir" \
    --overwrite --stop-after $((warmup + steps)) > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  read -r tps loss < <("$python" bench/metrics_tokens_per_s.py "$dir/metrics/rank0.jsonl" $warmup $((warmup + steps)) $((32 * 128)))
  local rss
  rss=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["peak_rss_mib"])' "$dir/summary.json")
  echo "$label $tps $loss $rss" >> "$results"
}

for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  for i in 0 1 2; do run "${ways[$(((round + i) % 3))]}"; done
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
print("`cpu.microbatch_threads=1` (the default: one microbatch after the other, every operator on the")
print("process's 2 intra-op threads) and `=2` (both at once, one on each of two threads, every operator on")
print("one thread), the latter also with libgomp's own spin count (`2-own-spin`: GOMP_SPINCOUNT=300000 given to")
print("`fsdpp run`, which then leaves it, where it gives the ranks of a microbatch_threads run 10,000;")
print(f"fsdpp/base/openmp_wait.hpp). Tokens/s over steps {int(warmup) + 1} to {int(warmup) + int(steps)}, from the run's metrics; rounds rotate which runs first.")
print()
print("| way (microbatch_threads) | tokens/s (median) | peak memory (MiB, median) | loss at the last step | rounds (tokens/s) |")
print("|---:|---:|---:|---:|---|")
for t in ["1", "2", "2-own-spin"]:
    print(f"| {t} | {statistics.median(tps[t]):.0f} | {statistics.median(rss[t]):.0f} | {loss[t][0]:.6f} | "
          f"{' '.join(f'{x:.0f}' for x in tps[t])} |")
print()
for a, b, what in [("1", "2", "microbatch_threads=2 over 1"), ("2-own-spin", "2", "microbatch_threads=2 with the spin count fsdpp run sets over libgomp's own"),
                   ("1", "2-own-spin", "microbatch_threads=2 with libgomp's own spin count over 1")]:
    ratios = [y / x for x, y in zip(tps[a], tps[b])]
    print(f"- {what}, round by round: **{statistics.median(ratios):.3f}x** (median; "
          f"{min(ratios):.3f}x to {max(ratios):.3f}x, {sum(r > 1 for r in ratios)} of {len(ratios)} rounds above 1).")
print()
same = all(abs(x - loss["1"][0]) <= 1e-4 * abs(loss["1"][0]) for t in tps for x in loss[t])
print(f"The last step's loss agrees across every run within 1e-4: {'yes' if same else 'no'}.")
PY
mv "$out.tmp" "$out"
cat "$out"
