#!/usr/bin/env bash
# The model's attention core three ways (bench/attention_bench.cpp), at 1 and 2 threads; writes
# bench/results/attention.md. Runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_attention_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-7}
out=bench/results/attention.md
{
  echo "# The attention core: composed, scaled_dot_product_attention, fused rotary"
  echo
  echo "Command: \`bash bench/run_attention_bench.sh $build $rounds\` ($(date +%F)), $(nproc) cores, OPENBLAS_* as set by the machine."
  echo
  echo "Forward and backward of the model's attention core at moe-small's shape (16 sequences of 128"
  echo "tokens, dim 128, 4 heads of 32), from the qkv projection to the attention output; the three ways"
  echo "alternate within each of $rounds rounds of 10 steps, each round starting one way further along;"
  echo "medians, and the median of the per-round ratios."
  echo "\`composed\` is how the model computed attention before: rotary by ATen operations (slice, neg,"
  echo "cat, multiplies, add), the [B, H, T, T] scores written out, masked, softmax, matmul. \`sdpa\` keeps"
  echo "that rotary and calls \`at::scaled_dot_product_attention(is_causal)\`. \`fused\` is the model now:"
  echo "\`models::rotary_qkv\` (q and k rotated and v laid out in one pass; the projection's gradient"
  echo "written in one pass; bitwise the composed rotary's values and gradients) and the same SDPA."
  echo "\`rotary-aten\` and \`rotary-fused\` time the rotation alone, each way (q + k carries both gradients)."
  echo
  echo "| threads | way | fwd+bwd ms (median) | speedup over composed |"
  echo "|---:|---|---:|---:|"
  for t in 1 2; do
    "$build/bench/fsdpp_attention_bench" --threads "$t" --rounds "$rounds" |
      sed -n 's/^RESULT attention way=\([a-z-]*\) .* threads=\([0-9]*\) fwd_bwd_ms=\([0-9.]*\) speedup_over_composed=\([0-9.]*\)$/| \2 | \1 | \3 | \4x |/p'
  done
} > "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
