#!/usr/bin/env bash
# The model's RMSNorm (alone and with the residual stream), SwiGLU, rotary, router and MoE row
# kernels against the ATen compositions (bench/kernels_bench.cpp), float32 and bfloat16, at 1 and 2
# threads; writes bench/results/kernels.md. Runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_kernels_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-7}
out=bench/results/kernels.md
{
  echo "# RMSNorm (alone and with the residual stream), SwiGLU's gate, the rotary embedding, the router and the MoE layer's rows: single-pass kernels against the ATen compositions"
  echo
  echo "Command: \`bash bench/run_kernels_bench.sh $build $rounds\` ($(date +%F)), $(nproc) cores of $cpu, OPENBLAS_* as set by the machine."
  echo
  echo "Forward and backward at moe-small's shapes for one dp 1 step (32 x 128 = 4096 rows): RMSNorm over"
  echo "dim 128 (gain in float32), SwiGLU's \`silu(a) * b\` over hidden 384, and the rotary embedding of q and k"
  echo "taken from the attention's projection [32, 128, 3, 4, 32] (4 heads of 32; its v passed through, the"
  echo "gradients given laid out [B, T, H, D] as the attention kernel gives them). \`aten\` is the composition"
  echo "(\`models::rms_norm_reference\`, \`models::swiglu_reference\`, \`models::rotary_reference\` on q and k),"
  echo "\`fused\` the kernel the model runs (\`models::rms_norm\`, \`models::swiglu\`, \`models::rotary_qkv\`)."
  echo "\`residual\`: a block's residual stream, \`x + r\` and the RMSNorm of that sum with both given gradients:"
  echo "\`aten\` is ATen's add, \`models::rms_norm\`'s kernel and autograd's sum of the two gradients (the"
  echo "model before \`models::residual_rms_norm\`), \`fused\` \`models::residual_rms_norm\`."
  echo "\`router\`: the router's softmax over 4 experts, top 2 normalised and logsumexp (\`models::softmax_top_k\`"
  echo "against ATen's softmax, topk, a division and logsumexp), every output given a gradient."
  echo "\`moe_rows\`: dropless routing's rows around the experts, 4096 tokens of 128 to 4 experts, top 2, the"
  echo "gather to [8192, 128] and the weighted sum back (no expert in between), forward and backward: \`aten\`"
  echo "as the model computed it before (\`at::sort\`, \`index_select\`, a multiply, \`index_add\` into zeros),"
  echo "\`fused\` \`models::sort_by_expert\`, \`models::dispatch_rows\` and \`models::combine_rows\`. In bfloat16"
  echo "the router's kernel and the rows' take the ATen operations (only the rows' sort differs): those rows'"
  echo "ratios are the bench's spread."
  echo "In bfloat16 \`models::swiglu\` is the composition (its"
  echo "kernel, tried there, measured 0.89x at 1 thread and 1.03x at 2: the conversions cost about what the"
  echo "passes save), so its two rows run the same code: their ratio is the bench's own spread. The ways"
  echo "alternate within each of $rounds rounds of 10 calls, each round starting one way further along;"
  echo "medians, and the median of the per-round ratios."
  echo
  echo "| dtype | threads | way | fwd+bwd ms (median) | speedup over aten |"
  echo "|---|---:|---|---:|---:|"
  for bf16 in 0 1; do
    for t in 1 2; do
      "$build/bench/fsdpp_kernels_bench" --threads "$t" --rounds "$rounds" --bf16 "$bf16" |
        sed -n 's/^RESULT kernels way=\([a-z_-]*\) rows=[0-9]* dtype=\([a-z0-9]*\) threads=\([0-9]*\) fwd_bwd_ms=\([0-9.]*\) speedup_over_aten=\([0-9.]*\)$/| \2 | \3 | \1 | \4 | \5x |/p'
    done
  done
} > "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
