#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, the CUDA toolkit, cmake, ninja, g++ and PyTorch
# 2.11 or newer (whose wheel brings LibTorch and NCCL) but possibly no Debian packages. What else it
# needs comes in a folder made by scripts/gpu-deps.sh on a machine that has them (header-only
# libraries, fortunes).
#   scripts/gpu-check.sh build DEPS_DIR [BUILD_DIR]    configure and build (default build-gpu)
#   scripts/gpu-check.sh run DEPS_DIR [BUILD_DIR]      the checks below, on what `build` left
#   scripts/gpu-check.sh all DEPS_DIR [BUILD_DIR]      both
# Build and run are separate so that each fits one call on a lent machine (the build folder stays
# between calls). `run` does:
#   1. the NCCL core test and the GPU test (NCCL through comm::Comm; fully_shard on CUDA against the
#      CPU; a captured CUDA graph step bitwise equal to the eager step);
#   2. the small MoE recipe on one GPU, eager and graph replay (steps/s, and equal losses); with
#      two or more GPUs also as a 1F1B pipeline over two GPUs (pp = 2), eager and graph replay (one
#      GPU cannot: NCCL refuses two ranks of one communicator on the same device);
#   3. the 16-expert top-2 bfloat16 model: fsdpp (graph replay) against PyTorch's fully_shard on
#      the same model, batch and GPU.
# A failing step does not stop the ones after it, so partial figures still come back; the exit
# status says whether all passed. Figures go to BUILD_DIR/gpu.md, to be copied to
# bench/results/gpu.md. Where $OUT is set (the device tool's return folder), the logs and gpu.md
# are copied there on every exit.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/gpu-check.sh build|run|all DEPS_DIR [BUILD_DIR]}
deps=$(cd "${2:?usage: scripts/gpu-check.sh build|run|all DEPS_DIR [BUILD_DIR]}" && pwd) || exit 1
out=${3:-build-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS
failed=()
say() { echo "gpu-check [$((SECONDS - start)) s]: $*"; }
# step NAME COMMAND...: runs it, logs it to $out/NAME.log, and goes on when it fails.
step() {
  local name=$1
  shift
  say "$name"
  if "$@" > >(tee "$out/$name.log") 2>&1; then
    say "$name: passed"
  else
    say "$name: FAILED (log: $out/$name.log)"
    failed+=("$name")
    return 1
  fi
}
deliver() {
  [[ -n ${OUT:-} ]] || return 0
  mkdir -p "$OUT"
  cp "$out"/*.log "$OUT"/ 2>/dev/null
  [[ -f $out/gpu.md ]] && cp "$out/gpu.md" "$OUT"/
  return 0
}
trap deliver EXIT

for tool in cmake ninja g++ python3; do
  command -v "$tool" > /dev/null || { echo "gpu-check: $tool is not installed" >&2; exit 1; }
done
cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
[[ -f $cuda/include/cuda_runtime.h ]] || { echo "gpu-check: no CUDA toolkit at $cuda (set CUDA_HOME)" >&2; exit 1; }
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
  { echo "gpu-check: python3 cannot import torch" >&2; exit 1; }

build() {
  # NCCL: the one LibTorch loads, from the nvidia-nccl wheel (a namespace package: no __file__, so
  # its folder comes from __path__), else the toolkit's.
  local nccl_root nccl_inc=$cuda/include nccl_lib=$cuda/lib64
  nccl_root=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
  if [[ -n $nccl_root && -f $nccl_root/include/nccl.h ]]; then
    nccl_inc=$nccl_root/include nccl_lib=$nccl_root/lib
  fi
  local nccl_so
  nccl_so=$(ls "$nccl_lib"/libnccl.so* 2>/dev/null | head -n 1)
  [[ -n $nccl_so ]] || { echo "gpu-check: no libnccl in $nccl_lib" >&2; return 1; }
  say "CUDA $cuda, NCCL $nccl_so, LibTorch $torch_prefix"
  cmake -S . -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_INCLUDE_PATH="$deps/include" -DCMAKE_LIBRARY_PATH="$deps/lib" -DCUDAToolkit_ROOT="$cuda" \
    -DFSDPP_WITH_NCCL=ON -DFSDPP_WITH_GLOO=OFF -DFSDPP_BUILD_BENCH=OFF \
    -DNCCL_INCLUDE_DIR="$nccl_inc" -DNCCL_LIBRARY="$nccl_so" &&
    ninja -C "$out" -j"$(nproc)" fsdpp_cli fsdpp_test_gpu fsdpp_test_nccl_core
}

small_runs() {
  local small=(train.steps=300 eval.interval=0 eval.batches=2 checkpoint.enabled=false logging.interval=100)
  "$out/fsdpp" run recipes/moe-small-gpu.json "${small[@]}" train.cuda_graph=false \
    logging.output_dir="$out/runs/small-eager" --overwrite &&
    "$out/fsdpp" run recipes/moe-small-gpu.json "${small[@]}" train.cuda_graph=true \
      logging.output_dir="$out/runs/small-graph" --overwrite
}

pipeline_runs() {
  local gpus
  gpus=$(nvidia-smi -L | grep -c '^GPU')
  if ((gpus < 2)); then
    echo "pp = 2: not run: $gpus GPU (NCCL refuses two ranks of one communicator on one device)"
    return 0
  fi
  local pp=(train.steps=100 eval.interval=0 eval.batches=2 checkpoint.enabled=false logging.interval=50
            parallel.dp=1 parallel.pp=2 parallel.microbatches=4 parallel.max_outstanding_sends=2)
  "$out/fsdpp" run recipes/moe-small-gpu.json "${pp[@]}" train.cuda_graph=false \
    logging.output_dir="$out/runs/pp-eager" --overwrite &&
    "$out/fsdpp" run recipes/moe-small-gpu.json "${pp[@]}" train.cuda_graph=true \
      logging.output_dir="$out/runs/pp-graph" --overwrite
}

big_runs() {
  local big=(parallel.dp=1 train.global_batch=8 data.seq_len=1024 train.steps=30 eval.interval=0
             eval.batches=1 checkpoint.enabled=false logging.interval=10)
  "$out/fsdpp" run recipes/moe-16x2-gpu.json "${big[@]}" logging.output_dir="$out/runs/big-fsdpp" --overwrite &&
    python3 bench/torch_moe_fsdp.py --config configs/moe-16x2.json --batch 8 --seq 1024 --steps 30 |
      tee "$out/torch.json"
}

figures() {
  python3 - "$out" <<'PY'
import json, os, subprocess, sys
out = sys.argv[1]
def summary(name):
    path = f"{out}/runs/{name}/summary.json"
    return json.load(open(path)) if os.path.exists(path) else None
eager, graph, big = summary("small-eager"), summary("small-graph"), summary("big-fsdpp")
pp_eager, pp_graph = summary("pp-eager"), summary("pp-graph")
torch = None
if os.path.exists(f"{out}/torch.json"):
    lines = open(f"{out}/torch.json").read().strip().splitlines()
    torch = json.loads(lines[-1]) if lines else None
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
lines = ["# GPU figures", "", f"Machine: {gpu}; PyTorch {torch['torch'] if torch else '?'}. "
         "Command: `bash scripts/gpu-check.sh all DEPS_DIR`", ""]
if os.path.exists(f"{out}/gpu_tests.log"):
    lines += ["GPU tests:", "", "```"] + [l for l in open(f"{out}/gpu_tests.log").read().splitlines()
                                          if any(k in l for k in ("MESSAGE", "graph replay", "world size", "test cases", "assertions", "ERROR"))] + ["```", ""]
if eager and graph:
    lines += ["| what | eager | CUDA graph replay | speed-up |", "|---|---|---|---|",
              f"| moe-small, 1 GPU, 2 microbatches of 16 x 128 (median step) | {eager['step_ms_median']:.2f} ms | "
              f"{graph['step_ms_median']:.2f} ms | {eager['step_ms_median'] / graph['step_ms_median']:.2f}x |", "",
              f"Final training loss after 300 steps: eager {eager['train_loss']!r}, graph {graph['train_loss']!r} "
              f"(equal: {eager['train_loss'] == graph['train_loss']})", ""]
else:
    lines += ["moe-small eager vs graph: did not complete (see small_moe.log)", ""]
if pp_eager and pp_graph:
    lines += ["| moe-small, 1F1B over 2 GPUs, 4 microbatches (median step) | eager | CUDA graph replay | speed-up |",
              "|---|---|---|---|",
              f"| pp = 2 | {pp_eager['step_ms_median']:.2f} ms | {pp_graph['step_ms_median']:.2f} ms | "
              f"{pp_eager['step_ms_median'] / pp_graph['step_ms_median']:.2f}x |", "",
              f"Final training loss after 100 steps: eager {pp_eager['train_loss']!r}, graph {pp_graph['train_loss']!r} "
              f"(equal: {pp_eager['train_loss'] == pp_graph['train_loss']})", ""]
elif os.path.exists(f"{out}/pipeline.log"):
    lines += ["pp = 2 eager vs graph: " + (open(f"{out}/pipeline.log").read().strip().splitlines() or ["no output"])[-1], ""]
if big and torch:
    big_tok = 8 * 1024 / (big["step_ms_median"] / 1e3)
    lines += ["| 16 experts top-2, bf16, batch 8 x 1024, 1 GPU | median step | tokens/s |", "|---|---|---|",
              f"| fsdpp (fully_shard, CUDA graph) | {big['step_ms_median']:.1f} ms | {big_tok:,.0f} |",
              f"| PyTorch fully_shard (Python) | {torch['step_ms_median']:.1f} ms | {torch['tokens_per_s']:,.0f} |",
              "", f"fsdpp / PyTorch: {big_tok / torch['tokens_per_s']:.2f}x"]
else:
    lines += ["16x2 fsdpp vs PyTorch: did not complete (see moe_16x2.log)"]
open(f"{out}/gpu.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
}

run() {
  nvidia-smi -L > /dev/null 2>&1 || { echo "gpu-check: no GPU visible (nvidia-smi -L failed)" >&2; return 1; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  [[ -x $out/fsdpp && -x $out/tests/fsdpp_test_gpu ]] ||
    { echo "gpu-check: nothing built in $out (run: scripts/gpu-check.sh build ...)" >&2; return 1; }
  export FSDPP_FORTUNES_DIR=$deps/fortunes
  step nccl_core "$out/tests/fsdpp_test_nccl_core"
  step gpu_tests "$out/tests/fsdpp_test_gpu" -s
  step small_moe small_runs
  step pipeline pipeline_runs
  step moe_16x2 big_runs
  step figures figures
  return 0  # each step's failure is already counted
}

case $mode in
  build) step build build ;;
  run) run || failed+=(run) ;;
  all) step build build && { run || failed+=(run); } ;;
  *) echo "gpu-check: unknown mode $mode (build, run, all)" >&2; exit 2 ;;
esac
if ((${#failed[@]})); then
  say "failed: ${failed[*]}"
  exit 1
fi
say "all passed"
