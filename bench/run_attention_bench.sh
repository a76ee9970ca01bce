#!/usr/bin/env bash
# The model's attention core five ways (bench/attention_bench.cpp), at 1 and 2 threads; writes
# bench/results/attention.md. Runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_attention_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-7}
out=bench/results/attention.md
{
  echo "# The attention core: composed, scaled_dot_product_attention, fsdpp's kernels"
  echo
  echo "Command: \`bash bench/run_attention_bench.sh $build $rounds\` ($(date +%F)), $(nproc) cores of $cpu, OPENBLAS_* as set by the machine."
  echo
  echo "Forward and backward of the model's attention core at moe-small's shape (16 sequences of 128"
  echo "tokens, dim 128, 4 heads of 32), from the qkv projection's output to the attention output; the ways"
  echo "alternate within each of $rounds rounds of 10 steps, each round starting one way further along;"
  echo "medians, and the median of the per-round ratios. MKL picks its kernels by instruction set, as in"
  echo "every fsdpp program (\`include/fsdpp/base/mkl_dispatch.hpp\`)."
  echo "\`composed\` is attention as ATen operations: rotary by slice, neg, cat, multiplies and add, the"
  echo "[B, H, T, T] scores written out, masked, softmax, matmul. \`sdpa\` keeps that rotary and calls"
  echo "\`at::scaled_dot_product_attention(is_causal)\` (ATen's CPU flash attention: 32-row tiles)."
  echo "\`fused-sdpa\` rotates by \`models::rotary_qkv\` (q and k rotated and v laid out in one pass; bitwise"
  echo "the composed rotary's values and gradients) and calls the same SDPA. \`fused\` is"
  echo "\`models::rotary_qkv\` and \`models::causal_attention\` (\`src/models/attention.cpp\`: blocks of 64"
  echo "query rows of a whole head, two BLAS products forward and five backward per block). \`one-pass\`"
  echo "is the model now: \`models::rotary_causal_attention\`, the two in one kernel (each head's q and k"
  echo "rotated into a thread's scratch as it attends, v read in place, the projection's gradient written"
  echo "directly: no [B, H, T, D] tensors of q, k, v or their gradients)."
  echo "\`rotary-aten\` and \`rotary-fused\` time the rotation alone, each way (q + k carries both gradients)."
  echo
  echo "| threads | way | fwd+bwd ms (median) | speedup over composed |"
  echo "|---:|---|---:|---:|"
  for t in 1 2; do
    "$build/bench/fsdpp_attention_bench" --threads "$t" --rounds "$rounds" > "$out.$t"
    sed -n 's/^RESULT attention way=\([a-z-]*\) .* threads=\([0-9]*\) fwd_bwd_ms=\([0-9.]*\) speedup_over_composed=\([0-9.]*\)$/| \2 | \1 | \3 | \4x |/p' "$out.$t"
  done
  echo
  echo "\`fused\` over \`fused-sdpa\` (the attention kernel against ATen's flash attention, the same rotary),"
  echo "median of the per-round ratios:"
  echo
  for t in 1 2; do
    sed -n 's/^RESULT attention_kernel threads=\([0-9]*\) speedup_over_sdpa=\([0-9.]*\)$/- threads \1: **\2x**/p' "$out.$t"
  done
  echo
  echo "\`one-pass\` over \`fused\` (the same operations; what writing and reading q, k, v and their"
  echo "gradients as tensors cost), median of the per-round ratios:"
  echo
  for t in 1 2; do
    sed -n 's/^RESULT one_pass threads=\([0-9]*\) speedup_over_fused=\([0-9.]*\)$/- threads \1: **\2x**/p' "$out.$t"
    rm -f "$out.$t"
  done
} > "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
