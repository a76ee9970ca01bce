#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, the CUDA toolkit and PyTorch 2.x (whose wheel
# brings LibTorch and NCCL) but possibly no Debian packages. What else it needs comes in a folder
# made by scripts/gpu-deps.sh on a machine that has them (header-only libraries, fortunes).
#   scripts/gpu-check.sh DEPS_DIR [OUT_DIR]
# It builds fsdpp against PyTorch's LibTorch with the NCCL backend, then runs:
#   1. the NCCL core test and the GPU test (NCCL through dist::Comm; fully_shard on CUDA against the
#      CPU; a captured CUDA graph step bitwise equal to the eager step);
#   2. the small MoE recipe on one GPU, eager and graph replay (steps/s, and equal losses);
#   3. the 16-expert top-2 bfloat16 model: fsdpp (graph replay) against PyTorch's fully_shard on
#      the same model, batch and GPU.
# Figures go to OUT_DIR/gpu.md (default build-gpu), to be copied to bench/results/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
deps=$(cd "${1:?usage: scripts/gpu-check.sh DEPS_DIR [OUT_DIR]}" && pwd)
out=${2:-build-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS
say() { echo "gpu-check [$((SECONDS - start)) s]: $*"; }

cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
[[ -f $cuda/include/cuda_runtime.h ]] || { echo "gpu-check: no CUDA toolkit at $cuda (set CUDA_HOME)" >&2; exit 1; }
nvidia-smi -L > /dev/null 2>&1 || { echo "gpu-check: no GPU visible (nvidia-smi -L failed)" >&2; exit 1; }
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
nccl_inc=$cuda/include nccl_lib=$cuda/lib64
if [[ ! -f $nccl_inc/nccl.h ]]; then
  # PyTorch's wheels bring NCCL as the nvidia-nccl package.
  nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)
  [[ -n $nccl_root ]] || { echo "gpu-check: nccl.h is neither in $cuda/include nor in an nvidia-nccl wheel" >&2; exit 1; }
  nccl_inc=$nccl_root/include nccl_lib=$nccl_root/lib
fi
nccl_so=$(ls "$nccl_lib"/libnccl.so* | head -n 1)
say "CUDA $cuda, NCCL $nccl_so, LibTorch $torch_prefix"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# ---- build
cmake -S . -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_INCLUDE_PATH="$deps/include" -DCUDAToolkit_ROOT="$cuda" \
  -DFSDPP_WITH_NCCL=ON -DFSDPP_WITH_GLOO=OFF -DFSDPP_BUILD_BENCH=OFF \
  -DNCCL_INCLUDE_DIR="$nccl_inc" -DNCCL_LIBRARY="$nccl_so" > "$out/configure.log" 2>&1 ||
  { tail -n 40 "$out/configure.log"; exit 1; }
ninja -C "$out" -j"$(nproc)" fsdpp_cli fsdpp_test_gpu fsdpp_test_nccl_core > "$out/build.log" 2>&1 ||
  { grep -m 20 -A 8 'error' "$out/build.log" || tail -n 40 "$out/build.log"; exit 1; }
say "built"

# ---- 1. correctness
"$out/tests/fsdpp_test_nccl_core"
"$out/tests/fsdpp_test_gpu" -s 2>&1 | tee "$out/test_gpu.log" | grep -E 'MESSAGE|graph replay|world size|test cases|assertions|ERROR|FAILED' || true
grep -q 'Status: SUCCESS' "$out/test_gpu.log" || { echo "gpu-check: the GPU test failed (log: $out/test_gpu.log)" >&2; exit 1; }
say "GPU tests passed"

# ---- 2. small MoE: eager against graph replay
export FSDPP_FORTUNES_DIR=$deps/fortunes
fsdpp=$out/fsdpp
small=(train.steps=300 eval.interval=0 eval.batches=2 checkpoint.enabled=false logging.interval=100)
"$fsdpp" run recipes/moe-small-gpu.json "${small[@]}" train.cuda_graph=false logging.output_dir="$out/runs/small-eager" --overwrite
"$fsdpp" run recipes/moe-small-gpu.json "${small[@]}" train.cuda_graph=true logging.output_dir="$out/runs/small-graph" --overwrite
say "small MoE runs done"

# ---- 3. 16 experts top-2, bfloat16, one GPU: fsdpp against PyTorch's fully_shard
big=(parallel.dp=1 train.global_batch=8 data.seq_len=1024 train.steps=30 eval.interval=0 eval.batches=1
     checkpoint.enabled=false logging.interval=10)
"$fsdpp" run recipes/moe-16x2-gpu.json "${big[@]}" logging.output_dir="$out/runs/big-fsdpp" --overwrite
python3 bench/torch_moe_fsdp.py --config configs/moe-16x2.json --batch 8 --seq 1024 --steps 30 | tee "$out/torch.json"
say "16x2 runs done"

python3 - "$out" <<'PY'
import json, sys, subprocess
out = sys.argv[1]
s = lambda name: json.load(open(f"{out}/runs/{name}/summary.json"))
eager, graph, big = s("small-eager"), s("small-graph"), s("big-fsdpp")
torch = json.loads(open(f"{out}/torch.json").read().strip().splitlines()[-1])
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
big_tok = 8 * 1024 / (big["step_ms_median"] / 1e3)
lines = [
  "# GPU figures", "", f"Machine: {gpu}; PyTorch {torch['torch']}. Command: `bash scripts/gpu-check.sh DEPS_DIR`", "",
  "| what | eager | CUDA graph replay | speed-up |", "|---|---|---|---|",
  f"| moe-small, 1 GPU, 2 microbatches of 16 x 128 (median step) | {eager['step_ms_median']:.2f} ms | {graph['step_ms_median']:.2f} ms | {eager['step_ms_median'] / graph['step_ms_median']:.2f}x |",
  "", f"Final training loss after 300 steps: eager {eager['train_loss']!r}, graph {graph['train_loss']!r} (equal: {eager['train_loss'] == graph['train_loss']})", "",
  "| 16 experts top-2, bf16, batch 8 x 1024, 1 GPU | median step | tokens/s |", "|---|---|---|",
  f"| fsdpp (fully_shard, CUDA graph) | {big['step_ms_median']:.1f} ms | {big_tok:,.0f} |",
  f"| PyTorch fully_shard (Python) | {torch['step_ms_median']:.1f} ms | {torch['tokens_per_s']:,.0f} |",
  "", f"fsdpp / PyTorch: {big_tok / torch['tokens_per_s']:.2f}x",
]
open(f"{out}/gpu.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
say "figures in $out/gpu.md"
