#!/usr/bin/env bash
# fsdpp run at dp 1 on the machine's cores: a step's microbatches one after the other, every operator
# on all intra-op threads (parallel.microbatch_threads=1, the default), against
# parallel.microbatch_threads=2 (both at once, one thread each; recipe.hpp says how), and the same
# with libgomp's own spin count (GOMP_SPINCOUNT=300000, which `fsdpp run` then leaves as it is, instead
# of the 10,000 it gives the ranks of such a run: fsdpp/base/openmp_wait.hpp), and the same with
# malloc's top pad left out (GLIBC_TUNABLES holding only the mmap and trim thresholds, which
# `fsdpp run` then leaves as they are: fsdpp/base/host_memory.hpp), on moe-small's recipe
# (2 microbatches of 16 x 128 tokens a step). Page faults a step from a run with and without the
# top pad, counted by perf stat where perf is installed. Rounds rotate which goes first; tokens/s over the steps
# after the warm-up, from each run's metrics; peak memory from its summary. Runs with the machine's
# OPENBLAS_* settings as they are; writes bench/results/dp1_threads.md, or the file given third.
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

# malloc's thresholds without the top pad
thresholds=glibc.malloc.mmap_threshold=268435456,glibc.malloc.trim_threshold=1073741824
# way: label, microbatch_threads, GOMP_SPINCOUNT for `fsdpp run` ("-": unset), GLIBC_TUNABLES (","
# for ":"; "-": unset)
ways=("1:1:-:-" "2:2:-:-" "2-own-spin:2:300000:-" "2-no-top-pad:2:-:$thresholds")
# Sets env to the arguments of `env` for a run: GOMP_SPINCOUNT ($1) and GLIBC_TUNABLES ($2) as
# given ("-": unset), OpenMP's and malloc's other variables unset.
set_env() {
  env=(-u GOMP_SPINCOUNT -u OMP_WAIT_POLICY -u GLIBC_TUNABLES -u MALLOC_MMAP_THRESHOLD_ -u MALLOC_TRIM_THRESHOLD_ -u MALLOC_TOP_PAD_)
  if [[ $1 != - ]]; then env+=("GOMP_SPINCOUNT=$1"); fi
  if [[ $2 != - ]]; then env+=("GLIBC_TUNABLES=${2//,/:}"); fi
}
run() {
  local label threads spins tunables dir=$work/run
  IFS=: read -r label threads spins tunables <<< "$1"
  set_env "$spins" "$tunables"
  rm -rf "$dir"
  env "${env[@]}" "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 parallel.microbatch_threads=$threads eval.interval=0 \
    checkpoint.interval=0 logging.interval=$warmup logging.plot=false logging.output_dir="$dir" \
    --overwrite --stop-after $((warmup + steps)) > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  read -r tps loss < <("$python" bench/metrics_tokens_per_s.py "$dir/metrics/rank0.jsonl" $warmup $((warmup + steps)) $((32 * 128)))
  local rss
  rss=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["peak_rss_mib"])' "$dir/summary.json")
  echo "$label $tps $loss $rss" >> "$results"
}

for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  for i in 0 1 2 3; do run "${ways[$(((round + i) % 4))]}"; done
done

# Page faults a step of the threads run with and without the top pad: runs of 10 and of 40 steps,
# the difference over 30 (start-up drops out), every process of the run; three times each, the
# two settings alternating (the count moves from run to run with where the heaps fall).
faults=$work/faults.txt
: > "$faults"
if command -v perf > /dev/null; then
  for rep in 1 2 3; do
    for tunables in - "$thresholds"; do
      counts=()
      set_env - "$tunables"
      for n in 10 40; do
        env "${env[@]}" perf stat -x, -e page-faults -o "$work/stat" -- "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 \
          parallel.microbatch_threads=2 eval.interval=0 checkpoint.interval=0 logging.plot=false \
          logging.output_dir="$work/run" --overwrite --stop-after $n > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
        counts+=("$(grep page-faults "$work/stat" | cut -d, -f1)")
      done
      echo "$([[ $tunables == - ]] && echo 2 || echo 2-no-top-pad) $(((counts[1] - counts[0]) / 30))" >> "$faults"
    done
  done
fi

"$python" - "$results" "$build" "$rounds" "$cpu" "$warmup" "$steps" "${3:-}" "$faults" > "$out.tmp" <<'PY'
import datetime, statistics, sys
from collections import defaultdict
path, build, rounds, cpu, warmup, steps, extra, faults_path = sys.argv[1:9]
faults = defaultdict(list)
for line in open(faults_path):
    t, n = line.split()
    faults[t].append(int(n))
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
print("one thread), the latter also with libgomp's own spin count (`2-own-spin`: GOMP_SPINCOUNT=300000 given to")
print("`fsdpp run`, which then leaves it, where it gives the ranks of a microbatch_threads run 10,000;")
print("fsdpp/base/openmp_wait.hpp), and also without malloc's top pad (`2-no-top-pad`: GLIBC_TUNABLES holding")
print("only the mmap and trim thresholds, which `fsdpp run` then leaves, where it adds a top pad of 64 MiB;")
print("fsdpp/base/host_memory.hpp: the second thread's arena then unmaps the heaps that its microbatch")
print(f"emptied, and faults them in again next step). Tokens/s over steps {int(warmup) + 1} to {int(warmup) + int(steps)}, from the run's metrics; rounds rotate which runs first.")
print("Page faults a step: every process of a run of 40 steps less one of 10, over 30 (perf stat); the")
print("median of three such counts, and the three.")
print()
print("| way (microbatch_threads) | tokens/s (median) | peak memory (MiB, median) | page faults a step | loss at the last step | rounds (tokens/s) |")
print("|---:|---:|---:|---:|---:|---|")
def fault_cell(t):
    return f"{statistics.median(faults[t]):.0f} ({' '.join(map(str, faults[t]))})" if faults[t] else ""

for t in ["1", "2", "2-own-spin", "2-no-top-pad"]:
    print(f"| {t} | {statistics.median(tps[t]):.0f} | {statistics.median(rss[t]):.0f} | {fault_cell(t)} | {loss[t][0]:.6f} | "
          f"{' '.join(f'{x:.0f}' for x in tps[t])} |")
print()
for a, b, what in [("1", "2", "microbatch_threads=2 over 1"), ("2-own-spin", "2", "microbatch_threads=2 with the spin count fsdpp run sets over libgomp's own"),
                   ("1", "2-own-spin", "microbatch_threads=2 with libgomp's own spin count over 1"),
                   ("2-no-top-pad", "2", "microbatch_threads=2 with malloc's top pad over without it")]:
    ratios = [y / x for x, y in zip(tps[a], tps[b])]
    print(f"- {what}, round by round: **{statistics.median(ratios):.3f}x** (median; "
          f"{min(ratios):.3f}x to {max(ratios):.3f}x, {sum(r > 1 for r in ratios)} of {len(ratios)} rounds above 1).")
print()
same = all(abs(x - loss["1"][0]) <= 1e-4 * abs(loss["1"][0]) for t in tps for x in loss[t])
print(f"The last step's loss agrees across every run within 1e-4: {'yes' if same else 'no'}.")
PY
mv "$out.tmp" "$out"
cat "$out"
