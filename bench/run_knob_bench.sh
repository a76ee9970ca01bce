#!/usr/bin/env bash
# Whether a setting earns its place: `fsdpp run` of a recipe with the setting one way (A) and the
# other (B), round after round (which goes first alternating, so that a busy spell falls on both),
# tokens/s over the steps after the warm-up from each run's metrics. A knob is worth keeping where
# the median of the rounds' B/A ratios is at least 3% from 1 and every round agrees on its side of
# 1 (beyond the rounds' spread); the report says which.
#   bash bench/run_knob_bench.sh NAME [rounds] KNOB ... 
# KNOB: "label|A|B", A and B each a space-separated list of recipe overrides, of --flags for `fsdpp
# run`, and of env:NAME=value entries for the ranks' environment (env:-NAME unsets NAME), e.g.
#   "microbatch threads (dp 1)|parallel.dp=1|parallel.dp=1 cpu.microbatch_threads=2"
# FSDPP_KNOB_RECIPE picks the recipe (default recipes/moe-small.json); FSDPP_KNOB_STEPS the steps
# timed (default 100, after 10 of warm-up). Runs with the machine's OPENBLAS_* settings as they are;
# writes bench/results/NAME.md.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/run_knob_bench.sh NAME [rounds] 'label|A|B' ..."
name=${1:?$usage}
shift
rounds=6
if [[ ${1:-} =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
(($#)) || { echo "$usage" >&2; exit 1; }
knobs=("$@")
recipe=${FSDPP_KNOB_RECIPE:-recipes/moe-small.json}
warmup=10
steps=${FSDPP_KNOB_STEPS:-100}
build=${FSDPP_BUILD:-build}
source bench/preamble.sh
out=bench/results/$name.md
results=$work/results.txt
: > "$results"

# run KNOB_INDEX SIDE(1|2): one run, its tokens/s appended to the results.
run() {
  local k=$1 side=$2 dir=$work/run
  local spec
  IFS='|' read -r -a spec <<< "${knobs[$k]}"
  local args=() envs=() unset_vars=()
  for word in ${spec[$side]}; do
    case $word in
      env:-*) unset_vars+=(-u "${word#env:-}") ;;
      env:*) envs+=("${word#env:}") ;;
      *) args+=("$word") ;;
    esac
  done
  rm -rf "$dir"
  env "${unset_vars[@]}" "${envs[@]}" "$fsdpp" run "$recipe" "${args[@]}" eval.interval=0 checkpoint.enabled=false \
    logging.interval=5 logging.plot=false logging.output_dir="$dir" train.steps=$((warmup + steps)) --overwrite \
    > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  local tokens tps loss
  tokens=$("$python" -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["train"]["global_batch"] * r["data"]["seq_len"])' "$dir/recipe.json")
  read -r tps loss < <("$python" bench/metrics_tokens_per_s.py "$dir/metrics/rank0.jsonl" $warmup $((warmup + steps)) "$tokens")
  echo "$k $side $tps" >> "$results"
}

for round in $(seq "$rounds"); do
  for k in "${!knobs[@]}"; do
    echo "round $round of $rounds: ${knobs[$k]}" >&2
    if ((round % 2)); then run "$k" 1; run "$k" 2; else run "$k" 2; run "$k" 1; fi
  done
done

"$python" - "$results" "$name" "$rounds" "$cpu" "$recipe" "$steps" "${knobs[@]}" > "$out.tmp" <<'PY'
import datetime, shlex, statistics, sys
path, name, rounds, cpu, recipe, steps, *knobs = sys.argv[1:]
runs = {}
for line in open(path):
    k, side, tps = line.split()
    runs.setdefault((int(k), int(side)), []).append(float(tps))
cmd = " ".join(["bash bench/run_knob_bench.sh", name, rounds, *map(shlex.quote, knobs)])
print(f"# Settings that must earn their place: {name}")
print()
print(f"Command: `{cmd}` ({datetime.date.today()}), {cpu}, `{recipe}`, OPENBLAS_* as set by the machine.")
print()
print(f"Each round runs A and B (which goes first alternating); tokens/s over steps 10 to {10 + int(steps)} from the")
print("runs' metrics. Kept: the median of the rounds' B/A ratios at least 3% from 1, with every round on")
print("the same side of 1.")
print()
print("| setting | A | B | tokens/s A (median) | tokens/s B (median) | B / A (median) | rounds' B / A | verdict |")
print("|---|---|---|---:|---:|---:|---|---|")
for k, knob in enumerate(knobs):
    label, a, b = knob.split("|")
    ta, tb = runs[k, 1], runs[k, 2]
    ratios = [y / x for x, y in zip(ta, tb)]
    med = statistics.median(ratios)
    same_side = all(r > 1 for r in ratios) or all(r < 1 for r in ratios)
    verdict = "matters" if abs(med - 1) >= 0.03 and same_side else "within noise"
    print(f"| {label} | `{a}` | `{b}` | {statistics.median(ta):,.0f} | {statistics.median(tb):,.0f} | **{med:.3f}** | "
          f"{min(ratios):.3f} to {max(ratios):.3f} | {verdict} |")
PY
mv "$out.tmp" "$out"
cat "$out"
