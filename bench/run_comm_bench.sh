#!/usr/bin/env bash
# Communication bandwidth, fsdpp's Gloo communicator beside c10d::ProcessGroupGloo, at world sizes
# 2 and 4 on loopback. Writes bench/results/comm_bandwidth.md.
#   bash bench/run_comm_bench.sh [build-dir] [max-mib]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
max_mib=${2:-64}
out=bench/results/comm_bandwidth.md
{
  echo "# Collective bandwidth: fsdpp Gloo communicator vs c10d::ProcessGroupGloo"
  echo
  echo "Command: \`bash bench/run_comm_bench.sh $build $max_mib\` ($(date -u +%Y-%m-%d), $(nproc) cores,"
  echo "LibTorch $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo '?'), libgloo $(dpkg-query -W -f='${Version}' libgloo-dev 2>/dev/null || echo '?'))."
  echo "Ratio = fsdpp busbw / c10d busbw; n/a = the operation is not supported by that implementation."
  for n in 2 4; do
    "$build/fsdpp" launch --nproc "$n" --no-prefix -- "$build/bench/fsdpp_comm_bench" --max-mib "$max_mib"
  done
} | tee "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out"
