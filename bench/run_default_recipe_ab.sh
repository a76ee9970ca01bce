#!/usr/bin/env bash
# The default recipe end to end, two builds side by side: `fsdpp run recipes/moe-small.json`, every
# step, evaluation and checkpoint as the recipe says, with each build's own `fsdpp` in turn, round
# after round (which goes first alternating). Reports each run's tokens/s and final validation loss
# (summary.json) and the per-round ratio of tokens/s; writes bench/results/NAME.md.
#   bash bench/run_default_recipe_ab.sh NAME [rounds] 'label|dir|overrides' 'label|dir|overrides'
# Each dir holds a build's fsdpp and its libraries (a build folder, or a copy of one); overrides
# (space-separated, may be empty) go to that build's `fsdpp run`, for a recipe key the build reads
# differently. Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/run_default_recipe_ab.sh NAME [rounds] 'label|dir|overrides' 'label|dir|overrides'"
name=${1:?$usage}
shift
rounds=3
if [[ ${1:-} =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
[[ $# -eq 2 ]] || { echo "$usage" >&2; exit 1; }
sides=("$@")
build=${FSDPP_BUILD:-build}
source bench/preamble.sh
out=bench/results/$name.md
results=$work/results.txt
: > "$results"
for side in "${sides[@]}"; do
  IFS='|' read -r label dir overrides <<< "$side"
  [[ -x $dir/fsdpp ]] || { echo "$label: no fsdpp in $dir" >&2; exit 1; }
done
run() {
  local label dir overrides
  IFS='|' read -r label dir overrides <<< "${sides[$1]}"
  rm -rf "$work/run"
  # shellcheck disable=SC2086  # overrides are words
  LD_LIBRARY_PATH=$(realpath "$dir") "$dir/fsdpp" run recipes/moe-small.json $overrides \
    logging.output_dir="$work/run" logging.plot=false > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  "$python" -c 'import json, sys; s = json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], s["tokens_per_s"], s["val_loss"])' \
    "$work/run/summary.json" "$label" "$2" >> "$results"
}
for r in $(seq "$rounds"); do
  echo "round $r of $rounds" >&2
  if ((r % 2)); then run 0 "$r"; run 1 "$r"; else run 1 "$r"; run 0 "$r"; fi
done
"$python" - "$results" "$name" "$rounds" "$cpu" "${sides[@]}" > "$out.tmp" <<'PY'
import collections, datetime, statistics, sys
path, name, rounds, cpu, *sides = sys.argv[1:]
runs = collections.defaultdict(dict)
for line in open(path):
    label, r, tps, val = line.split()
    runs[label][int(r)] = (float(tps), float(val))
labels = [s.split("|")[0] for s in sides]
a, b = labels
print(f"# The default recipe end to end: {a} and {b}")
print()
print(f"Command: `bash bench/run_default_recipe_ab.sh {name} {rounds} " + " ".join(f"'{s}'" for s in sides)
      + f"` ({datetime.date.today()}), {cpu}, OPENBLAS_* as set by the machine.")
print()
print("`fsdpp run recipes/moe-small.json` in full (every step, evaluation and checkpoint), each build's own")
print("`fsdpp`, rounds alternating which goes first; tokens/s and the final validation loss from summary.json.")
print()
print("| build | tokens/s (median) | rounds | final validation loss |")
print("|---|---:|---|---|")
for l in labels:
    tps = [runs[l][r][0] for r in sorted(runs[l])]
    vals = sorted({f"{runs[l][r][1]:.6f}" for r in runs[l]})
    print(f"| {l} | {statistics.median(tps):.0f} | {' '.join(f'{x:.0f}' for x in tps)} | {', '.join(vals)} |")
ratios = [runs[b][r][0] / runs[a][r][0] for r in sorted(runs[a]) if r in runs[b]]
print()
print(f"{b} / {a} tokens/s: **{statistics.median(ratios):.3f}x** (rounds {min(ratios):.3f} to {max(ratios):.3f})")
PY
mv "$out.tmp" "$out"
cat "$out"
