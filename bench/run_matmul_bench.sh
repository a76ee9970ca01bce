#!/usr/bin/env bash
# The model's weight products by ATen (MKL) and by oneDNN (bench/matmul_bench.cpp), forward and
# backward, at 1 and 2 threads; writes bench/results/matmul.md. Runs with the machine's OPENBLAS_*
# settings as they are.
#   bash bench/run_matmul_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-7}
out=bench/results/matmul.md
source bench/cpuinfo.sh
cpu=$(cpuinfo 'model name')
family=$(cpuinfo 'cpu family')
avx512=$(grep -q avx512f /proc/cpuinfo && echo "with AVX-512" || echo "without AVX-512")
{
  echo "# The model's weight products: ATen's (MKL) against oneDNN's"
  echo
  echo "Command: \`bash bench/run_matmul_bench.sh $build $rounds\` ($(date +%F)), $(nproc) cores ($cpu, family $family, $avx512), OPENBLAS_* as set by the machine."
  echo
  echo "Forward and backward (x W^T, then the gradients of x and W) at moe-small's shapes for one"
  echo "microbatch of a dp 2 rank (8 x 128 = 1024 tokens): \`qkv\` the attention's projection ([1024, 128]"
  echo "by [384, 128]), \`w2\` the dense SwiGLU's down projection ([1024, 384] by [128, 384]), \`experts\`"
  echo "the 4 experts' w1 on the 2048 routed rows, grouped ([4, 192, 128]), the rows' split between"
  echo "experts changing every call as dropless routing's does. \`aten\` is \`at::linear\` and"
  echo "\`at::_grouped_mm\` (MKL's sgemm), \`onednn\` \`models::linear\` and \`models::grouped_linear\`"
  echo "(\`include/fsdpp/models/matmul.hpp\`). The ways alternate within each of $rounds rounds of 10 calls,"
  echo "each round starting one way further along; medians, and the median of the per-round ratios."
  echo
  echo "MKL runs each way: \`vendor\` with \`FSDPP_MKL_VENDOR_CHECK=1\` (MKL's own choice of kernels, PyTorch's"
  echo "on this CPU), \`isa\` as fsdpp runs it by default, told to pick its kernels by instruction set"
  echo "(\`include/fsdpp/base/mkl_dispatch.hpp\`). oneDNN picks its own either way."
  echo
  echo "| MKL | threads | way | fwd+bwd ms (median) | speedup over aten |"
  echo "|---|---:|---|---:|---:|"
  for mkl in vendor isa; do
    for t in 1 2; do
      if [ "$mkl" = vendor ]; then check=1; else check=0; fi
      FSDPP_MKL_VENDOR_CHECK=$check "$build/bench/fsdpp_matmul_bench" --threads "$t" --rounds "$rounds" |
        sed -n "s/^RESULT matmul way=\([a-z0-9_-]*\) rows=[0-9]* threads=\([0-9]*\) fwd_bwd_ms=\([0-9.]*\) speedup_over_aten=\([0-9.]*\)\$/| $mkl | \2 | \1 | \3 | \4x |/p"
    done
  done
} > "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
