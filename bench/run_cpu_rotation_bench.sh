#!/usr/bin/env bash
# dp = 2 with the computing threads rotating over the CPUs (dist.cpu_rotation_ms, Note [rotating
# CPUs] in include/fsdpp/base/cpu_binding.hpp) against each rank staying on its own CPU, in the
# same run: `fsdpp run recipes/moe-small.json` (its placement: compute thread bound, nice 19) with
# FSDPP_CPU_ROTATION_ALTERNATE_MS, so that the threads rotate in every other window of 1.5 s and
# stay put in between; the trace's steps are sorted by the window they ran in
# (bench/cpu_rotation_trace.py). Comparing windows of one run, a second apart, leaves out most of
# what a busy shared machine does to whole runs. First, how the two CPUs' speeds move against each
# other (bench/cpu_speed_pair.py). Writes bench/results/cpu_rotation.md, or the file given fourth.
#   bash bench/run_cpu_rotation_bench.sh [build-dir] [runs per period] [steps per run] [output] [periods]
# periods: rotation periods in ms, space-separated in one argument (default "5 10 20 40").
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
runs=${2:-2}
steps=${3:-300}
out=${4:-bench/results/cpu_rotation.md}
source bench/preamble.sh
alternate=1500
read -r -a periods <<< "${5:-5 10 20 40}"

echo "the two CPUs' speeds, 20 s" >&2
"$python" bench/cpu_speed_pair.py 20 > "$work/speed.txt"
: > "$work/results.txt"
for run in $(seq 1 "$runs"); do
  for period in "${periods[@]}"; do
    echo "run $run of $runs: rotation every $period ms" >&2
    d=$work/run-$run-$period
    FSDPP_CPU_ROTATION_ALTERNATE_MS=$alternate "$fsdpp" run recipes/moe-small.json dist.cpu_rotation_ms="$period" \
      eval.interval=0 checkpoint.interval=0 logging.interval=10 logging.plot=false --overwrite \
      --stop-after $((steps + 1)) --trace --trace-steps "$steps" logging.output_dir="$d" > "$d.log" 2>&1 ||
      { cat "$d.log"; exit 1; }
    echo "period=$period run=$run $("$python" bench/cpu_rotation_trace.py "$d/trace.json" $alternate)" >> "$work/results.txt"
  done
done

"$python" - "$work" "$build" "$runs" "$steps" "$out" "$cpu" "$alternate" "${5:-}" <<'PY' > "$out.tmp"
import datetime, re, statistics, sys
work, build, runs, steps, out, cpu, alternate, periods = sys.argv[1:]
rows = [dict(re.findall(r"(\w+)=([-\w.]+)", line)) for line in open(f"{work}/results.txt")]
speed = [dict(re.findall(r"(\w+)=([-\w.]+)", line)) for line in open(f"{work}/speed.txt")]
print("# dp = 2 with the computing threads rotating over the CPUs")
print()
extra = "" if out == "bench/results/cpu_rotation.md" and not periods else " " + out
if periods:
    extra += f' "{periods}"'
print(f"Command: `bash bench/run_cpu_rotation_bench.sh {build} {runs} {steps}{extra}` ({datetime.date.today()}), 2 cores of {cpu}, "
      "OPENBLAS_* as set by the machine.")
print()
print("How the two CPUs' speeds move against each other (`bench/cpu_speed_pair.py 20`: one pinned")
print("process per CPU running the same single-threaded products; per time bin, the first CPU's")
print("time over the second's): the spread is the standard deviation of that ratio's logarithm, the")
print("autocorrelation that of one bin with the next.")
print()
print("| bin | bins | spread | autocorrelation |")
print("|---:|---:|---:|---:|")
for s in speed:
    print(f"| {s['bin_ms']} ms | {s['bins']} | {float(s['spread']) * 100:.1f}% | {s['autocorrelation']} |")
print()
print(f"`fsdpp run recipes/moe-small.json dist.cpu_rotation_ms=P` at dp = 2 (the recipe's placement:")
print(f"each rank's computing thread bound to its CPU, nice 19), {steps} steps traced per run, with")
print(f"`FSDPP_CPU_ROTATION_ALTERNATE_MS={alternate}`: the threads rotate in every other {int(alternate) / 1000:g} s window")
print("and stay on their own CPU in between. Steps wholly inside a window are kept (the first 3 of")
print("a run dropped). *Gap*: the mean distance between the two ranks' issue of the step's last")
print("reduce-scatter, where the rank ahead starts waiting for the other (over the steps whose")
print("collectives the flight recorder still held). *Speed-up*: the fixed steps' mean time over the")
print("rotating steps', per run; the last column is their median.")
print()
print("| rotation period | steps rotating / fixed | step, rotating (ms) | step, fixed (ms) | gap, rotating (ms) | gap, fixed (ms) | speed-up per run | median |")
print("|---:|---:|---:|---:|---:|---:|---|---:|")
for period in sorted({int(r["period"]) for r in rows}):
    rs = [r for r in rows if int(r["period"]) == period]
    med = lambda k: statistics.median(float(r[k]) for r in rs)
    ups = [float(r["speedup"]) for r in rs]
    print(f"| {period} ms | {sum(int(r['rotating_steps']) for r in rs)} / {sum(int(r['fixed_steps']) for r in rs)} "
          f"| {med('rotating_ms'):.1f} | {med('fixed_ms'):.1f} | {med('rotating_gap_ms'):.1f} | {med('fixed_gap_ms'):.1f} "
          f"| {' '.join(f'{u:.3f}' for u in ups)} | **{statistics.median(ups):.3f}x** |")
PY
mv "$out.tmp" "$out"
cat "$out"
