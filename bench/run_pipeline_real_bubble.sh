#!/usr/bin/env bash
# Pipeline bubbles with real compute: `fsdpp run recipes/moe-small-pp.json` (moe-small's model in 2
# pipeline ranks, global batch 32 x 128) at 8 microbatches under several schedules, traced; each
# rank's measured bubble (1 - time in stage computations / pipeline step time, median over the
# traced steps) beside the simulator's prediction for the same plan with the per-stage costs the
# trace measured (bench/pipeline_trace_bubble.cpp). Writes bench/results/pipeline_real_bubble.md.
#   bash bench/run_pipeline_real_bubble.sh [build-dir]
# Runs with the machine's OPENBLAS_* settings as they are. Both ranks share this machine's 2 cores,
# one compute thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
out=bench/results/pipeline_real_bubble.md
m=8
{
  echo "# Pipeline bubbles with real compute, beside the simulator"
  echo
  echo "Command: \`bash bench/run_pipeline_real_bubble.sh $build\` ($(date +%F)), 2 cores, OPENBLAS_* as set by the machine."
  echo
  echo "\`fsdpp run recipes/moe-small-pp.json parallel.microbatches=$m --trace\` (moe-small's model over 2 pipeline"
  echo "ranks, global batch 32 x 128 tokens, so microbatches of 4 sequences; 3 traced steps after the"
  echo "first). Measured bubble of a rank: 1 - (time in its stage computations) / (its pipeline step"
  echo "time), median over the traced steps; a computation's time starts after the receive it waited"
  echo "for. Simulated: the same lowered plan under \`pipeline::simulate\`, each (stage, F/B/I/W) costing"
  echo "the median the trace measured, communication free. The step times differ by what sends,"
  echo "receives and the framework add between computations."
  echo
  echo "| schedule | stages/rank | rank | measured bubble | simulated bubble | measured / simulated | pipeline step (ms) | simulated step (ms) |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|"
} > "$out.tmp"
costs=""
for spec in "1F1B 1" "GPipe 1" "Interleaved1F1B 2" "ZBVZeroBubble 2"; do
  set -- $spec
  schedule=$1 v=$2
  dir=$work/$schedule
  "$build/fsdpp" run recipes/moe-small-pp.json parallel.schedule=$schedule parallel.stages_per_rank=$v \
    parallel.microbatches=$m eval.interval=0 checkpoint.interval=0 logging.plot=false logging.output_dir="$dir" \
    --overwrite --stop-after 5 --trace > "$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
  "$build/bench/fsdpp_pipeline_trace_bubble" "$dir/trace.json" $schedule 2 $v $m > "$dir.txt"
  cat "$dir.txt" >&2
  costs+="- $schedule: $(sed -n 's/^measured costs (ms, median): //p' "$dir.txt")"$'\n'
  sed -n 's/^RESULT rank=\([0-9]*\) measured_bubble=\([0-9.]*\) simulated_bubble=\([0-9.]*\) measured_step_ms=\([0-9.]*\) simulated_step_ms=\([0-9.]*\)/\1 \2 \3 \4 \5/p' "$dir.txt" |
    while read -r rank mb sb ms ss; do
      echo "| $schedule | $v | $rank | $mb | $sb | $(python3 -c "print(f'{$mb / $sb:.2f}' if $sb > 0 else '-')") | $ms | $ss |"
    done >> "$out.tmp"
  sed -n 's/^RESULT mean measured_bubble=\([0-9.]*\) simulated_bubble=\([0-9.]*\)/\1 \2/p' "$dir.txt" |
    while read -r mb sb; do
      echo "| $schedule | $v | mean | $mb | $sb | $(python3 -c "print(f'{$mb / $sb:.2f}' if $sb > 0 else '-')") | | |"
    done >> "$out.tmp"
done
{
  echo
  echo "Measured costs per stage and computation (ms, median over the traced steps):"
  echo
  printf "%s" "$costs"
} >> "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
