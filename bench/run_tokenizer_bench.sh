#!/usr/bin/env bash
# Encode throughput of fsdpp's tokenizer.json reader beside Hugging Face tokenizers itself
# (bench/tokenizer_bench.py says how); writes bench/results/tokenizers.md.
#   bash bench/run_tokenizer_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-6}
source bench/preamble.sh
FSDPP_CPU="$cpu" "$python" bench/tokenizer_bench.py "$build/tests/fsdpp_tokenizer_probe" bench/results/tokenizers.md \
  --rounds "$rounds"
cat bench/results/tokenizers.md
