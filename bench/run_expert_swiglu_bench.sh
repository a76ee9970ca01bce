#!/usr/bin/env bash
# The MoE layer's expert SwiGLU, the composition against models::expert_swiglu's kernel at several
# chunk sizes (bench/expert_swiglu_bench.cpp), at 1024 and 512 rows per expert (a microbatch of 16
# and of 8 sequences at moe-small's top 2 of 4) and at 1 and 2 threads; writes
# bench/results/expert_swiglu_kernel.md. Runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_expert_swiglu_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-30}
out=bench/results/expert_swiglu_kernel.md
{
  echo "# The experts' SwiGLU: the composition against one kernel, expert after expert in chunks of rows"
  echo
  echo "Command: \`bash bench/run_expert_swiglu_bench.sh $build $rounds\` ($(date +%F)), $(nproc) cores of $cpu, OPENBLAS_* as set by the machine."
  echo
  echo "One MoE layer's experts at moe-small's shapes (4 experts, dim 128, expert_hidden 192, every"
  echo "expert given the same rows), forward and backward, the caches cleared (64 MB written, untimed)"
  echo "before each, as a training step meets its operands; the ways alternate within each of $rounds"
  echo "rounds; medians, and the median of the per-round ratios. \`composition\` is"
  echo "\`models::expert_swiglu_reference\`, what the model ran before the kernel: \`models::grouped_linear\`"
  echo "(ATen's \`at::_grouped_mm\`) for w1, w3 and w2 and \`models::swiglu\`'s gate, under autograd."
  echo "\`kernel-C\` is \`models::expert_swiglu\` with chunks of C rows (\`src/models/cpu/kernels.cpp\`; the"
  echo "model's is \`kExpertChunkRows\`, 128; C = the rows per expert takes each expert whole)."
  echo
  echo "| rows per expert | threads | way | forward ms | backward ms | total ms | speed-up over composition |"
  echo "|---:|---:|---|---:|---:|---:|---:|"
  for rows in 1024 512; do
    for t in 1 2; do
      "$build/bench/fsdpp_expert_swiglu_bench" --threads "$t" --rounds "$rounds" --rows "$rows" |
        sed -n 's/^RESULT expert_swiglu rows=\([0-9]*\) threads=\([0-9]*\) way=\([a-z0-9-]*\) forward_ms=\([0-9.]*\) backward_ms=\([0-9.]*\) total_ms=\([0-9.]*\) speedup=\([0-9.]*\)$/| \1 | \2 | \3 | \4 | \5 | \6 | \7x |/p'
    done
  done
} > "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
