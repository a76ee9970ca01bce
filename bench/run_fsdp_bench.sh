#!/usr/bin/env bash
# fully_shard figures: throughput against one unsharded process and PyTorch DDP, reduce-scatter
# overlap on and off, per-rank memory at dp 1, 2, 4, and per-unit framework cost.
# Writes bench/results/fsdp.md.   bash bench/run_fsdp_bench.sh [build-dir] [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
steps=${2:-30}
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
  env OMP_NUM_THREADS=1 "$bin" throughput --unsharded --steps 1 2>&1 | grep '^BLAS'
  echo
  echo "## Throughput (median of 3 interleaved runs of each)"
  for trial in 1 2 3; do
    run env OMP_NUM_THREADS=2 "$bin" throughput --unsharded --threads 2 --steps "$steps"
    run $launch --nproc 2 -- "$bin" throughput --sharded --steps "$steps"
    run $launch --nproc 2 -- "$bin" throughput --sharded --no-overlap --steps "$steps"
    run $launch --nproc 2 -- "$bin" throughput --sharded --no-reshard --steps "$steps"
    run $launch --nproc 2 -- "$python" bench/ddp_baseline.py --steps "$steps"
  done | grep -v '^BLAS' | awk '{
      key = $0; sub(/ tokens\/s=.*/, "", key); split($0, f, "tokens/s="); split(f[2], v, " ");
      n[key]++; vals[key, n[key]] = v[1]; if (!(key in order)) { order[key] = ++k; keys[k] = key } }
    END { for (i = 1; i <= k; i++) { key = keys[i]; m = n[key];
      for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (vals[key, b] < vals[key, a]) {
        t = vals[key, a]; vals[key, a] = vals[key, b]; vals[key, b] = t }
      printf "%s tokens/s=%s (runs:", key, vals[key, int((m + 1) / 2)];
      for (a = 1; a <= m; a++) printf " %s", vals[key, a]; print ")" } }'
  echo
  echo "## Memory (parameters + gradients + AdamW moments, the largest rank)"
  for n in 1 2 4; do run $launch --nproc "$n" -- "$bin" memory; done
  echo
  echo "## Per-unit framework cost (200 units of Linear(8, 8), 1 rank)"
  run $launch --nproc 1 -- "$bin" unit-cost --steps "$steps"
} | tee "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out"
