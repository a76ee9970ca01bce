#!/usr/bin/env bash
# fully_shard figures: throughput against one unsharded process and PyTorch DDP, reduce-scatter
# overlap on and off, per-rank memory at dp 1, 2, 4, and per-unit framework cost.
# Writes bench/results/fsdp.md.   bash bench/run_fsdp_bench.sh [build-dir] [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
steps=${2:-30}
FSDPP_SETUP_BENCH=1 scripts/setup.sh >/dev/null  # python3-torch for the DDP baseline
bin=$build/bench/fsdpp_fsdp_bench
launch="$build/fsdpp launch --no-prefix"
out=bench/results/fsdp.md
run() { "$@" 2>&1 | grep -E '^(RESULT|BLAS)' | sed 's/^RESULT /- /'; }
{
  echo "# fully_shard benchmarks"
  echo
  echo "Command: \`bash bench/run_fsdp_bench.sh $build $steps\` ($(date -u +%Y-%m-%d), $(nproc) cores)."
  echo "Model: bench/transformer.hpp (4 blocks, dim 128, 4 heads, seq 64, vocab 256), AdamW, global"
  echo "batch 16 sequences. Each sharded rank and each DDP rank uses 1 intra-op thread; the unsharded"
  echo "process uses 2 threads, so every row uses both cores."
  echo
  echo "## Throughput"
  run env OMP_NUM_THREADS=2 "$bin" throughput --unsharded --threads 2 --steps "$steps"
  run $launch --nproc 2 -- "$bin" throughput --sharded --steps "$steps"
  run $launch --nproc 2 -- "$bin" throughput --sharded --no-overlap --steps "$steps"
  run $launch --nproc 2 -- "$bin" throughput --sharded --no-reshard --steps "$steps"
  run $launch --nproc 2 -- /usr/bin/python3 bench/ddp_baseline.py --steps "$steps"
  echo
  echo "## Memory (parameters + gradients + AdamW moments, the largest rank)"
  for n in 1 2 4; do run $launch --nproc "$n" -- "$bin" memory; done
  echo
  echo "## Per-unit framework cost (200 units of Linear(8, 8), 1 rank)"
  run $launch --nproc 1 -- "$bin" unit-cost --steps "$steps"
} | tee "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out"
