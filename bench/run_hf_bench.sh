#!/usr/bin/env bash
# Importing and exporting a transformers checkpoint of moe-16x2's size (1.2 B parameters, float32):
# a random MixtralForCausalLM with moe-16x2's dimensions (every layer MoE, no shared expert, since
# Mixtral has neither), saved by save_pretrained; then `fsdpp import` and `fsdpp export` of the
# result, each timed with its peak resident memory (GNU time); and a dp=2 run starting from the
# directory (model.init_from), each rank reading only its shards' rows, stopped once the model is
# loaded, with rank 0's peak memory at that point as the run logs it. Writes
# bench/results/hf_interop.md.
#   bash bench/run_hf_bench.sh [build]
set -euo pipefail
build=${1:-build}
source bench/preamble.sh
report=bench/results/hf_interop.md

"$python" - "$work/hf" <<'PY'
import sys, torch
from transformers import MixtralConfig, MixtralForCausalLM
c = MixtralConfig(vocab_size=256, hidden_size=1024, intermediate_size=1408, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=16, num_local_experts=16, num_experts_per_tok=2,
                  max_position_embeddings=2048, tie_word_embeddings=False, sliding_window=None,
                  bos_token_id=None, eos_token_id=None)
torch.manual_seed(0)
with torch.device("meta"):
    m = MixtralForCausalLM(c)
m = m.to_empty(device="cpu")
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.02)
m.save_pretrained(sys.argv[1])
print(sum(p.numel() for p in m.parameters()), "parameters")
PY

measure() {  # label, command...: seconds and peak RSS (GiB)
  local label=$1; shift
  /usr/bin/time -f "%e %M" -o "$work/time" "$@" >"$work/out" 2>&1 || { cat "$work/out"; exit 1; }
  read -r secs kib <"$work/time"
  printf '| %s | %.1f | %.2f |\n' "$label" "$secs" "$(echo "$kib / 1048576" | bc -l)"
}
checkpoint_gib=$(du -sb "$work/hf" | awk '{printf "%.2f", $1 / 2^30}')
{
  echo "# Transformers checkpoints in and out at moe-16x2's size"
  echo
  echo "\`bash bench/run_hf_bench.sh $build\` on $(date -u +%Y-%m-%d), $cpu, $(nproc) cores,"
  echo "$(free -g | awk '/Mem:/ {print $2}') GiB of memory."
  echo
  echo "A random MixtralForCausalLM with moe-16x2's dimensions (1024 wide, 16 layers of 16 experts"
  echo "1408 wide, top 2; every layer MoE and no shared expert, which Mixtral lacks): 1.2 B parameters,"
  echo "a $checkpoint_gib GiB float32 checkpoint written by save_pretrained. Peak: the process's largest resident set,"
  echo "which counts the pages of the input mapped into memory (file pages, which the kernel can drop"
  echo "again); each output tensor is made and written one at a time."
  echo
  echo "| command | seconds | peak GiB |"
  echo "|---|---|---|"
  measure "fsdpp import DIR -o model.safetensors" "$fsdpp" import "$work/hf" -o "$work/model.safetensors"
  measure "fsdpp export model.safetensors -o DIR2 --format hf" "$fsdpp" export "$work/model.safetensors" -o "$work/out-hf"
  measure "fsdpp export model.safetensors -o DIR3 --dtype bfloat16" "$fsdpp" export "$work/model.safetensors" -o "$work/out-bf16" --dtype bfloat16
} | tee "$report"
{
  echo
  echo "A run from the directory at dp=2 (\`model.init_from\`, 2 ranks on this machine), stopped once the"
  echo "model is loaded: every rank builds the model without memory, shards it and copies from the mapped"
  echo "files only the rows of its shards. Rank 0's memory as the run logs it when loading is done: its own"
  echo "(anonymous: its shards, half the model's 4.38 GiB, and the process's runtime), the file pages of the"
  echo "rows it read (which the kernel can drop again), and its peak so far (both kinds):"
  echo
  cat > "$work/load.json" <<JSON
{"model": {"init_from": "$work/hf"}, "data": {"source": "synthetic", "seq_len": 64},
 "parallel": {"dp": 2}, "train": {"steps": 1, "global_batch": 2},
 "logging": {"output_dir": "$work/load-run", "plot": false}, "checkpoint": {"interval": 0}, "eval": {"interval": 0}}
JSON
  start=$(date +%s.%N)
  setsid "$fsdpp" run "$work/load.json" > "$work/load.log" 2>&1 &
  pid=$!
  until grep -q "weights from" "$work/load.log" || ! kill -0 $pid 2>/dev/null; do sleep 0.2; done
  end=$(date +%s.%N)
  kill -- -$pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  line=$(grep "weights from" "$work/load.log") || { cat "$work/load.log"; exit 1; }
  own=$(echo "$line" | sed -n 's/.*resident: \([0-9]*\) MiB of its own.*/\1/p')
  file=$(echo "$line" | sed -n 's/.* \([0-9]*\) MiB of the file.*/\1/p')
  peak=$(echo "$line" | sed -n 's/.*peak so far \([0-9]*\) MiB.*/\1/p')
  echo "| command | seconds to loaded | own GiB | file pages GiB | peak GiB |"
  echo "|---|---|---|---|---|"
  printf '| fsdpp run (dp=2, model.init_from DIR) | %.1f | %.2f | %.2f | %.2f |\n' "$(echo "$end - $start" | bc -l)" \
    "$(echo "$own / 1024" | bc -l)" "$(echo "$file / 1024" | bc -l)" "$(echo "$peak / 1024" | bc -l)"
} | tee -a "$report"
