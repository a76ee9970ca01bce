#!/usr/bin/env bash
# The optimizer step alone on the default model's parameters (configs/moe-small.json, 1.36M in 34
# tensors, fixed gradients): fsdp::AdamW on ATen's fused CPU kernel, fsdp::AdamW's tensor
# expression (what a GPU runs; fused=false), and LibTorch's torch::optim::AdamW, at 2 threads (dp 1)
# and 1 (a dp 2 rank, which updates half of them). Writes bench/results/adamw.md.
#   bash bench/run_adamw_bench.sh [build-dir] [rounds]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-15}
out=bench/results/adamw.md
lines=$(for t in 2 1; do "$build/bench/fsdpp_fsdp_bench" adamw --threads "$t" --rounds "$rounds" --steps 10 | grep '^RESULT'; done)
{
  echo "# The optimizer step: fsdp::AdamW fused, as a tensor expression, and LibTorch's AdamW"
  echo
  echo "Command: \`bash bench/run_adamw_bench.sh $build $rounds\` ($(date -u +%Y-%m-%d)), $(nproc) cores of $(cpuinfo "model name")."
  echo
  echo "\`fsdpp_fsdp_bench adamw\`: the parameters of configs/moe-small.json's model with fixed gradients,"
  echo "matrices decayed (0.1) and vectors not, as the trainer splits them; the three optimizers take"
  echo "10 steps each in turn, in rotating order, for each round; milliseconds per step, medians over"
  echo "rounds. fsdp::AdamW on the CPU runs ATen's fused AdamW kernel (one pass per parameter, bitwise"
  echo "torch.optim.AdamW(fused=True): tests/fsdp/test_torch_fsdp.py); with \`fused = false\` it runs the"
  echo "tensor expression of src/fsdp/adamw.cpp, 11 passes and 4 temporaries per parameter, as it does"
  echo "on a GPU."
  echo
  echo "| threads | fsdp::AdamW (fused) | tensor expression | LibTorch torch::optim::AdamW | expression / fused |"
  echo "|---:|---:|---:|---:|---:|"
  echo "$lines" | sed -E 's/.*threads=([0-9]+).*fused_ms=([0-9.]+) expression_ms=([0-9.]+) libtorch_ms=([0-9.]+).*/\1 \2 \3 \4/' |
    awk '{ printf "| %s | %s ms | %s ms | %s ms | %.1fx |\n", $1, $2, $3, $4, $3 / $2 }'
  echo
  echo "Raw:"
  echo
  echo "$lines" | sed 's/^RESULT /- /'
} > "$out"
cat "$out"
