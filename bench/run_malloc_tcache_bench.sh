#!/usr/bin/env bash
# Whether a larger per-thread cache of freed small blocks in glibc's malloc (the tunable
# glibc.malloc.tcache_count, 7 by default) pays. Callgrind counts fewer instructions for
# fully_shard's per-unit cost with it (bench/results/unit_cost_not_kept.md); this times it, in
# alternating order each round, with malloc's own count and with each count given:
#  - the unit-cost model (`fsdpp_fsdp_bench unit-cost --steps 2 --rounds 100`: 200 units of
#    Linear(8, 8), one rank, flight recorder on), us per unit per step and the unsharded step;
#  - `fsdpp run recipes/moe-small.json parallel.dp=1` (2 threads, the default
#    dist.keep_freed_memory=true, whose thresholds fsdpp run joins to the count), tokens/s over
#    steps 6-25 and the run's system CPU seconds.
# Prints one line per run and the medians; runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_malloc_tcache_bench.sh [build-dir] [rounds] [count ...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-4}
shift 2 || shift $#
counts=("$@")
[ ${#counts[@]} -gt 0 ] || counts=(256 4000)
python=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python
[ -z "${GLIBC_TUNABLES:-}" ] || { echo "unset GLIBC_TUNABLES first: this compares malloc's own settings"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results=$work/results.txt
: > "$results"
settings=(own "${counts[@]}")

# Runs a command with the setting's GLIBC_TUNABLES (none for "own").
with_setting() {
  local s=$1; shift
  if [ "$s" = own ]; then "$@"; else GLIBC_TUNABLES=glibc.malloc.tcache_count=$s "$@"; fi
}

for r in $(seq "$rounds"); do
  order=("${settings[@]}")
  (( r % 2 )) || order=($(printf '%s\n' "${settings[@]}" | tac))
  for s in "${order[@]}"; do
    line=$(with_setting "$s" env WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$((20000 + RANDOM % 20000)) "$build/bench/fsdpp_fsdp_bench" unit-cost --steps 2 --rounds 100 |
      grep '^RESULT unit-cost ' | tail -1) || { echo "tcache_count=$s: the bench printed no result"; exit 1; }
    d=$work/run-$s
    with_setting "$s" /usr/bin/time -f "%S" -o "$work/time" "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 \
      eval.interval=0 checkpoint.interval=0 logging.interval=1 logging.plot=false logging.output_dir="$d" \
      --overwrite --stop-after 25 > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
    rate=$("$python" bench/metrics_tokens_per_s.py "$d/metrics/rank0.jsonl" 5 25 4096 | cut -d' ' -f1)
    echo "$s $line tokens_per_s=$rate system_s=$(cat "$work/time")" | tee -a "$results"
  done
done
"$python" - "$results" "${settings[@]}" <<'PY'
import re, statistics, sys
runs = {}  # setting -> one {key: value} per round
for line in open(sys.argv[1]):
    setting, rest = line.split(" ", 1)
    runs.setdefault(setting, []).append({k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", rest)})
def med(setting, key):
    return statistics.median(r[key] for r in runs[setting])
for s in sys.argv[2:]:
    print(f"median tcache_count={s}: unit-cost {med(s, 'us_per_unit_per_step'):.1f} us per unit per step, "
          f"unsharded step {med(s, 'plain_step_us'):.0f} us; moe-small dp 1 {med(s, 'tokens_per_s'):.0f} tokens/s, "
          f"system CPU {med(s, 'system_s'):.2f} s")
PY
