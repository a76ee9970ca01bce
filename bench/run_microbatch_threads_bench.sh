#!/usr/bin/env bash
# Whether a dp 1 step on 2 cores would gain from running its two microbatches at once, one per
# thread, instead of one after the other on 2 intra-op threads (bench/microbatch_threads_bench.cpp:
# moe-small's model, 2 microbatches of 16 x 128 tokens, forward and backward, gradients summed).
# Runs with the machine's OPENBLAS_* settings as they are;
# writes bench/results/microbatch_threads.md, or the file given third.
#   bash bench/run_microbatch_threads_bench.sh [build-dir] [rounds] [output]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-21}
out=${3:-bench/results/microbatch_threads.md}
log=$work/log
"$build/bench/fsdpp_microbatch_threads_bench" --rounds "$rounds" --per-round 5 | tee "$log"
grep -q '^RESULT microbatch-threads ' "$log" || { echo "the bench printed no result"; exit 1; }
field() { grep '^RESULT' "$log" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
{
  echo "# A dp 1 step's two microbatches: one after the other on 2 threads, or at once on one thread each"
  echo
  echo "Command: \`bash bench/run_microbatch_threads_bench.sh $build $rounds\` ($(date +%F)), $(nproc) cores of $cpu, OPENBLAS_* as set by the machine."
  echo
  echo "moe-small's model, two microbatches of 16 x 128 tokens, forward and backward (no optimizer step),"
  echo "\`bench/microbatch_threads_bench.cpp\`. *sequential*: one microbatch after the other, every operator"
  echo "on 2 intra-op threads, as \`fsdpp run recipes/moe-small.json parallel.dp=1\` runs them. *concurrent*:"
  echo "both at once, one on each of two threads, every operator on one thread: a second copy of the model"
  echo "whose parameters share the first's storage (own gradients and router statistics), its gradients"
  echo "added into the first's at the end. The two ways alternate within each of $rounds rounds of 5 steps,"
  echo "each round starting one way further along; medians, and the median of the per-round ratios."
  echo
  echo "| way | ms per step's forward and backward (median) | tokens/s |"
  echo "|---|---:|---:|"
  for w in sequential concurrent; do
    ms=$(field ${w}_ms)
    echo "| $w | $ms | $(awk -v ms="$ms" -v n="$(field tokens_per_step)" 'BEGIN { printf "%.0f", n / ms * 1000 }') |"
  done
  echo
  echo "Concurrent over sequential, round by round: **$(field speedup)x**. Gradients of the two ways: largest"
  echo "difference $(field grad_max_rel_diff) of the largest gradient (the products run on other thread counts)."
  echo
  echo "Per round, ms per step's forward and backward:"
  echo
  for w in sequential concurrent; do
    echo "- $w: $(grep "^$w:" "$log" | sed 's/.*rounds: *//; s/ /, /g')"
  done
  echo
  echo "\`fsdpp run\` takes the sequential way at dp 1 by default and the concurrent one with"
  echo "\`cpu.microbatch_threads=2\`: it saves what the second intra-op thread spends waiting, and costs"
  echo "a second copy of the model's gradients and a second microbatch's activations held at once. Two"
  echo "threads each running its own half of the batch is also what dp 2 does, in two processes with one"
  echo "thread each and the gradients summed by reduce-scatter (\`recipes/moe-small.json\`)."
} > "$out"
echo "wrote $out"
