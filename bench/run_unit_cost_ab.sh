#!/usr/bin/env bash
# fully_shard's per-unit cost, timed for two builds side by side: the unit-cost model (200 units of
# Linear(8, 8), one rank, flight recorder on) run by each build in turn, round after round, so
# that a busy spell on a shared machine falls on both. Each run prints its own paired median (the
# sharded step against the unsharded one, in one process); this script compares the two builds
# round by round. Counted figures, which do not move with the load, are bench/run_unit_cost_count.sh's.
#   bash bench/run_unit_cost_ab.sh [rounds] before=dir after=dir
# Each dir holds a build's fsdpp_fsdp_bench, libfsdpp.so and libfsdpp_gloo.so (copied from its
# tree). Writes bench/results/unit_cost_ab.md; about 12 seconds per build per round.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FSDPP_BUILD:-build}
source bench/preamble.sh
rounds=15
if [[ ${1:-} =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
[[ $# -eq 2 && $rounds -gt 0 ]] || { echo "usage: bash bench/run_unit_cost_ab.sh [rounds] before=dir after=dir"; exit 1; }
for v in "$@"; do
  dir=${v#*=}
  [[ $v == *=* && -x $dir/fsdpp_fsdp_bench && -f $dir/libfsdpp.so ]] ||
    { echo "$v: expected label=dir, dir holding fsdpp_fsdp_bench, libfsdpp.so and libfsdpp_gloo.so"; exit 1; }
done
out=bench/results/unit_cost_ab.md
# One rank without the launcher, as bench/run_unit_cost_count.sh runs it.
export WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
port=$((20000 + RANDOM % 20000))
for r in $(seq "$rounds"); do
  for v in "$@"; do
    port=$((port + 1))
    dir=${v#*=}
    echo "round $r: ${v%%=*}" >&2
    line=$(MASTER_PORT=$port LD_LIBRARY_PATH=$dir "$dir/fsdpp_fsdp_bench" unit-cost --steps 2 --rounds 100 2>&1 |
      grep '^RESULT unit-cost ' | tail -1) || { echo "${v%%=*}: the bench printed no result"; exit 1; }
    echo "${v%%=*} $line" >> "$work/results"
  done
done
"$python" - "$work/results" "$rounds" "$1" "$2" > "$out.tmp" <<'PY'
import datetime, re, statistics, sys
path, rounds, a, b = sys.argv[1], sys.argv[2], sys.argv[3].split("=")[0], sys.argv[4].split("=")[0]
runs = {a: [], b: []}
for line in open(path):
    label, rest = line.split(" ", 1)
    runs[label].append({k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", rest)})
def col(label, key):
    return [r[key] for r in runs[label]]
ratios = [y / x for x, y in zip(col(a, "us_per_unit_per_step"), col(b, "us_per_unit_per_step"))]
print("# fully_shard's per-unit cost, two builds timed side by side")
print()
print(f"Command: `bash bench/run_unit_cost_ab.sh {rounds} {sys.argv[3]} {sys.argv[4]}` ({datetime.date.today()}).")
print()
print("The unit-cost model (200 units of Linear(8, 8), one rank, flight recorder on), run by each build")
print("in turn: `fsdpp_fsdp_bench unit-cost --steps 2 --rounds 100`, whose figure is the median over")
print("100 pairs of an unsharded and a sharded 2-step run, less the unsharded one, per unit per step.")
print("Each column is the median over this script's rounds.")
print()
print("| build | us per unit per step | from the fastest rounds of each side | unsharded step (us) |")
print("|---|---:|---:|---:|")
for label in (a, b):
    print(f"| {label} | {statistics.median(col(label, 'us_per_unit_per_step')):.1f} | "
          f"{statistics.median(col(label, 'min_us_per_unit_per_step')):.1f} | "
          f"{statistics.median(col(label, 'plain_step_us')):,.0f} |")
print()
print(f"{b} over {a}, round by round: median ratio {statistics.median(ratios):.3f}; {b} lower in "
      f"{sum(r < 1 for r in ratios)} of {len(ratios)} rounds.")
print()
print("Per round, us per unit per step:")
print()
print(f"- {a}: " + ", ".join(f"{v:.1f}" for v in col(a, "us_per_unit_per_step")))
print(f"- {b}: " + ", ".join(f"{v:.1f}" for v in col(b, "us_per_unit_per_step")))
PY
mv "$out.tmp" "$out"
cat "$out"
