#!/usr/bin/env bash
# Pipeline bubbles at pp=2 and pp=4, m=8: measured (sleep-timed stages, so independent of the core
# count) beside the simulator and the closed form. Writes bench/results/pipeline_bubbles.md.
#   bash bench/run_pipeline_bench.sh [build-dir] [unit-ms]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
unit=${2:-10}
out=bench/results/pipeline_bubbles.md
{
  echo "# Pipeline bubbles"
  echo
  echo "Command: \`bash bench/run_pipeline_bench.sh $build $unit\` ($(date -u +%Y-%m-%d)). Stages sleep"
  echo "$unit ms per unit of work (F = I = W = 1, B = 2); bubble = 1 - time in stage compute / step"
  echo "time, mean over ranks. \"simulated\" uses the same costs, with the first stage computing no"
  echo "input gradient (as the executor does); \"uniform\" assumes every stage's backward costs the"
  echo "same, which is what the closed form (p-1)/(m+p-1) for GPipe and 1F1B assumes. The measured"
  echo "figure includes real communication and framework time, which the simulator does not."
  echo
  echo "| schedule | pp | stages/rank | microbatches | measured | simulated | uniform | closed form |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|"
  for pp in 2 4; do
    for s in GPipe 1F1B Interleaved1F1B LoopedBFS InterleavedZeroBubble ZBVZeroBubble DualPipeV; do
      "$build/fsdpp" launch --nproc "$pp" --no-prefix -- "$build/bench/fsdpp_pipeline_bench" "$s" 8 "$unit" | grep '^|'
    done
  done
} | tee "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out"
