#!/usr/bin/env bash
# The GPU check: everything one GPU can prove, as one call on a lent machine (NVIDIA GPU, CUDA
# toolkit, cmake, ninja, g++, Python with PyTorch 2.11 or newer, whose wheel brings LibTorch and
# NCCL; no Debian packages, no network). What else it needs comes in a folder that
# scripts/gpu-deps.sh makes on a machine with Debian's packages (header-only libraries and the
# fortunes corpus; no binary library, so the machine's C library may be older than Debian's).
#
#   scripts/gpu-check.sh [--deps DIR] [--build-dir DIR] [--budget SECONDS] [--only a,b] [--skip a,b]
#   scripts/gpu-check.sh --dry-run [--build-dir build] ...   the same plumbing on the CPU, here
#
# Steps, in order (each under its own timeout, cut to what is left of the budget):
#   build           configure and build the GPU targets against the machine's PyTorch
#   nccl_core       the NCCL core alone (tests/comm/test_nccl_core.cpp)
#   gpu_tests       tests/gpu/test_gpu.cpp: collectives, the watchdog after a capture, a failed
#                   capture, fully_shard on CUDA, a captured MoE step bitwise equal to eager
#   collectives_w1  every collective, float32 and bfloat16, at world 1 and 2 (2 processes that
#   collectives_w2  share the GPU: fsdpp launch --share-gpu), then captured and replayed
#   graph_pp1       moe-small, 2 microbatches: CUDA graph replay bitwise equal to eager, 30 steps
#   graph_pp2_1f1b  pp = 2, 1F1B, 4 microbatches, max_outstanding_sends = 2: the same
#   graph_pp2_v     pp = 2, ZBVZeroBubble (2 stages per rank): the same
#   parallel        dp = 2, dp = 2 with ep = 2, and pp = 2 against world 1, eager, within 1e-5
#   speed_small     moe-small, eager against graph replay (from graph_pp1's runs)
#   big_fsdpp       16 experts top-2 bfloat16 (configs/moe-16x2.json), fsdpp with a CUDA graph
#   big_torch       the same model, batch and GPU under PyTorch's own fully_shard (runs whether
#                   or not big_fsdpp passed), then tokens/s and MFU of both
#
# After every step, $OUT (the device tool's return folder; default BUILD_DIR/gpu-out) holds two
# files: gpu.md (the results so far) and gpu-logs.tar.gz (every step's log so far). A hang costs
# only its own step; a step that cannot fit in what is left of the budget is reported as not run.
# Exit status 0 when every step that ran passed.
#
# --dry-run runs the same steps on the CPU with the CPU build (Gloo, no capture, fewer steps), so
# that the plumbing (timeouts, comparisons, reports, archive) is tested here (test scripts.gpu_check).
# FSDPP_GPU_CHECK_HANG=STEP:SECONDS makes STEP hang under a limit of SECONDS (to test timeouts).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
self=$root/scripts/gpu-check.sh

if [[ ${1:-} != _step ]]; then  # `_step NAME` (see step()) inherits the settings below
  deps=.deps/gpu build_dir="" budget=450 dry=0 only="" skip=""
  while (($#)); do
    case $1 in
      --deps) deps=$2; shift 2 ;;
      --build-dir) build_dir=$2; shift 2 ;;
      --budget) budget=$2; shift 2 ;;
      --only) only=,$2,; shift 2 ;;
      --skip) skip=,$2,; shift 2 ;;
      --dry-run) dry=1; shift ;;
      -h|--help) sed -n '2,/^set -uo/p' "$self" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
      *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
  done
  [[ -n $build_dir ]] || build_dir=$([[ $dry == 1 ]] && echo build || echo build-gpu)
  mkdir -p "$build_dir"
  build_dir=$(cd "$build_dir" && pwd)
  work=$build_dir/gpu-check
  python=${FSDPP_PYTHON:-python3}
  [[ $dry == 1 && -z ${FSDPP_PYTHON:-} && -x ${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python ]] &&
    python=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python
  bin=$build_dir/fsdpp
  runs=$work/runs
  # The corpus the recipes train on comes in the dependency folder (no Debian package there).
  [[ $dry == 0 && -d $deps/fortunes && -z ${FSDPP_FORTUNES_DIR:-} ]] && export FSDPP_FORTUNES_DIR=$(cd "$deps/fortunes" && pwd)
  export deps build_dir work runs python bin dry
fi

# ------------------------------------------------------------------ the steps
# Each runs in its own process (the script again, as `_step NAME`), so that timeout(1) can end it
# and everything it started: `fsdpp launch` stops its ranks on SIGTERM, and they die with it.

# fsdpp run with the settings every run here shares; NAME is its output directory under $runs.
fsdpp_run() {
  local name=$1 recipe=$2
  shift 2
  local device=(train.device=cuda)
  [[ $dry == 1 ]] && device=(train.device=cpu train.cuda_graph=false)
  local steps=30
  [[ $dry == 1 ]] && steps=4
  "$bin" run "$recipe" train.steps=$steps eval.interval=0 eval.batches=1 checkpoint.enabled=false logging.interval=1 \
    logging.plot=false logging.output_dir="$runs/$name" "$@" "${device[@]}" --overwrite
}
report() { "$python" "$root/scripts/gpu_check_report.py" "$@"; }

step_build() {
  [[ $dry == 1 ]] && { ls -l "$bin" "$build_dir/tests/fsdpp_test_rank"; return; }
  local cuda torch_prefix nccl_root nccl_inc nccl_lib nccl_so
  cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
  [[ -f $cuda/include/cuda_runtime.h ]] || { echo "no CUDA toolkit at $cuda (set CUDA_HOME)"; return 1; }
  torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 1
  # NCCL: the one LibTorch loads, from the nvidia-nccl wheel (a namespace package: its folder comes
  # from __path__), else the toolkit's.
  nccl_inc=$cuda/include nccl_lib=$cuda/lib64
  nccl_root=$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
  [[ -n $nccl_root && -f $nccl_root/include/nccl.h ]] && nccl_inc=$nccl_root/include nccl_lib=$nccl_root/lib
  nccl_so=$(ls "$nccl_lib"/libnccl.so* 2>/dev/null | head -n 1)
  [[ -n $nccl_so ]] || { echo "no libnccl in $nccl_lib"; return 1; }
  echo "CUDA $cuda, NCCL $nccl_so, LibTorch $torch_prefix, $(nproc) cores"
  local deps_abs
  deps_abs=$(cd "$root" && cd "$deps" && pwd) || { echo "no dependency folder $deps (scripts/gpu-deps.sh makes it)"; return 1; }
  local t0=$SECONDS
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDPP_PYTHON="$(command -v "$python")" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_INCLUDE_PATH="$deps_abs/include" \
    -DCUDAToolkit_ROOT="$cuda" -DFSDPP_WITH_NCCL=ON -DFSDPP_WITH_GLOO=OFF -DFSDPP_WITH_SENTENCEPIECE=OFF \
    -DFSDPP_BUILD_BENCH=OFF \
    -DNCCL_INCLUDE_DIR="$nccl_inc" -DNCCL_LIBRARY="$nccl_so" &&
    ninja -C "$build_dir" -j"$(nproc)" fsdpp_cli fsdpp_test_gpu fsdpp_test_gpu_ranks fsdpp_test_nccl_core &&
    echo "built in $((SECONDS - t0)) s on $(nproc) cores"
}

# A test binary that reports itself skipped (77) without a GPU counts as passed in a dry run.
gpu_binary() {
  "$@"
  local rc=$?
  [[ $dry == 1 && $rc == 77 ]] && { echo "(dry run: no GPU, skipped as expected)"; return 0; }
  return $rc
}
step_nccl_core() { gpu_binary "$build_dir/tests/fsdpp_test_nccl_core"; }
step_gpu_tests() { gpu_binary "$build_dir/tests/fsdpp_test_gpu" -s; }

collectives() {
  local n=$1 program=("$build_dir/tests/fsdpp_test_gpu_ranks")
  [[ $dry == 1 ]] && program=("$build_dir/tests/fsdpp_test_rank" collectives)
  "$bin" launch --nproc "$n" --share-gpu -- "${program[@]}"
}
step_collectives_w1() { collectives 1; }
step_collectives_w2() { collectives 2; }

# Eager and graph runs of one layout, then their per-step losses compared bitwise.
eager_vs_graph() {
  local name=$1
  shift
  fsdpp_run "$name-eager" recipes/moe-small-gpu.json train.cuda_graph=false "$@" &&
    fsdpp_run "$name-graph" recipes/moe-small-gpu.json train.cuda_graph=true "$@" &&
    report equal "$runs/$name-eager" "$runs/$name-graph"
}
step_graph_pp1() { eager_vs_graph pp1 parallel.dp=1 train.grad_accum=2; }
step_graph_pp2_1f1b() {
  eager_vs_graph pp2-1f1b parallel.dp=1 parallel.pp=2 parallel.schedule=1F1B parallel.microbatches=4 \
    parallel.max_outstanding_sends=2 --share-gpu
}
step_graph_pp2_v() {
  eager_vs_graph pp2-zbv parallel.dp=1 parallel.pp=2 parallel.stages_per_rank=2 parallel.schedule=ZBVZeroBubble \
    parallel.microbatches=4 parallel.max_outstanding_sends=2 --share-gpu
}

# Dropless routing: capacity routing's limits depend on the microbatch a rank sees, so only dropless
# routing gives every layout the same mathematics. Every layout runs microbatches of 4 sequences.
step_parallel() {
  local common=(recipes/moe-small-gpu.json train.cuda_graph=false model.routing=dropless train.global_batch=16)
  local rc=0
  fsdpp_run world1 "${common[@]}" parallel.dp=1 train.grad_accum=4 || return 1
  fsdpp_run dp2 "${common[@]}" parallel.dp=2 train.grad_accum=2 --share-gpu && report close "$runs/world1" "$runs/dp2" 1e-5 || rc=1
  fsdpp_run dp2-ep2 "${common[@]}" parallel.dp=2 parallel.ep=2 train.grad_accum=2 --share-gpu &&
    report close "$runs/world1" "$runs/dp2-ep2" 1e-5 || rc=1
  fsdpp_run pp2 "${common[@]}" parallel.dp=1 parallel.pp=2 parallel.microbatches=4 --share-gpu &&
    report close "$runs/world1" "$runs/pp2" 1e-5 || rc=1
  return $rc
}

step_speed_small() {
  [[ -f $runs/pp1-eager/summary.json && -f $runs/pp1-graph/summary.json ]] || eager_vs_graph pp1 parallel.dp=1 train.grad_accum=2 > /dev/null
  report speed "$runs/pp1-eager" "$runs/pp1-graph"
}

big_settings() {
  if [[ $dry == 1 ]]; then  # the plumbing only: a tiny model on the CPU
    echo "recipes/moe-16x2-gpu.json model=configs/tiny.json parallel.dp=1 train.global_batch=2 data.seq_len=32"
  else
    echo "recipes/moe-16x2-gpu.json parallel.dp=1 train.global_batch=8 data.seq_len=1024"
  fi
}
step_big_fsdpp() {
  read -r -a settings <<< "$(big_settings)"
  fsdpp_run big-fsdpp "${settings[@]}" train.cuda_graph=true logging.interval=10
}
step_big_torch() {
  local config=configs/moe-16x2.json args=(--batch 8 --seq 1024 --steps 30)
  [[ $dry == 1 ]] && config=configs/tiny.json args=(--batch 2 --seq 32 --steps 4 --warmup 1 --device cpu)
  "$python" bench/torch_moe_fsdp.py --config "$config" "${args[@]}" | tee "$work/torch.json"
  local rc=${PIPESTATUS[0]}
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  report big "$runs/big-fsdpp" "$work/torch.json" "$config" "${gpu:-CPU (dry run)}"
  return "$rc"
}

if [[ ${1:-} == _step ]]; then  # one step, in its own process (step() below)
  name=$2
  if [[ ${FSDPP_GPU_CHECK_HANG:-} == "$name:"* ]]; then echo "hanging, as FSDPP_GPU_CHECK_HANG asks"; sleep 100000; fi
  "step_$name"
  exit $?
fi

# ------------------------------------------------------------------ running them
steps=(build nccl_core gpu_tests collectives_w1 collectives_w2 graph_pp1 graph_pp2_1f1b graph_pp2_v parallel speed_small
       big_fsdpp big_torch)
declare -A limit=([build]=330 [nccl_core]=60 [gpu_tests]=150 [collectives_w1]=60 [collectives_w2]=90 [graph_pp1]=90
                  [graph_pp2_1f1b]=120 [graph_pp2_v]=120 [parallel]=180 [speed_small]=60 [big_fsdpp]=150 [big_torch]=150)
declare -A needs=([build]=60 [big_torch]=30)  # the least worth starting with; others 20 s
start=$SECONDS
out_dir=${OUT:-$build_dir/gpu-out}
rm -rf "$work"
mkdir -p "$work/logs" "$runs" "$out_dir"
failed=()
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
{
  echo "# GPU check"
  echo
  echo "Machine: ${gpu:-no GPU (dry run on $(nproc) CPU cores)}; PyTorch ${torch_version:-?}; $(date -u '+%Y-%m-%d %H:%M UTC')."
  echo "Command: \`bash scripts/gpu-check.sh$([[ $dry == 1 ]] && echo " --dry-run")\` (logs: gpu-logs.tar.gz)."
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
} > "$work/head.md"
: > "$work/table.md"
: > "$work/details.md"

deliver() {
  cat "$work/head.md" "$work/table.md" "$work/details.md" > "$work/gpu.md"
  cp "$work/gpu.md" "$out_dir/gpu.md.tmp" && mv "$out_dir/gpu.md.tmp" "$out_dir/gpu.md"
  tar -czf "$out_dir/gpu-logs.tar.gz.tmp" -C "$work" logs && mv "$out_dir/gpu-logs.tar.gz.tmp" "$out_dir/gpu-logs.tar.gz"
}

step() {
  local name=$1 lim=${limit[$1]} need=${needs[$1]:-20} log=$work/logs/$1.log
  local left=$((budget - (SECONDS - start) - 10))  # 10 s kept for the last report
  [[ ${FSDPP_GPU_CHECK_HANG:-} == "$name:"* ]] && lim=${FSDPP_GPU_CHECK_HANG#*:} need=1
  ((lim > left)) && lim=$left
  if ((lim < need)); then
    echo "| $name | not run: ${left} s of the budget left |  |" >> "$work/table.md"
    echo "gpu-check: $name: not run (${left} s left)"
    failed+=("$name")
    deliver
    return
  fi
  echo "gpu-check [$((SECONDS - start)) s]: $name (limit $lim s)"
  local t0=$SECONDS rc
  timeout -k 5 "$lim" "$self" _step "$name" > "$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) result
  case $rc in
    0) result=passed ;;
    124 | 137) result="TIMED OUT after $lim s" ;;
    *) result="FAILED (exit $rc)" ;;
  esac
  [[ $rc == 0 ]] || failed+=("$name")
  echo "| $name | $result | $took |" >> "$work/table.md"
  # What the step found: lines that comparisons and tests print, and the tail of a failure.
  {
    echo
    echo "## $name: $result"
    echo
    grep -E '^(- |\|[ -]|fsdpp / PyTorch|(\[rank[0-9]+\]: )?rank [0-9]+/[0-9]+ .*ok|built in|\[doctest\] (test cases|assertions)|.*MESSAGE|small MoE step)' "$log" || true
    if [[ $rc != 0 ]]; then echo; echo '```'; tail -n 15 "$log"; echo '```'; fi
  } >> "$work/details.md"
  echo "gpu-check: $name: $result ($took s)"
  deliver
}

for s in "${steps[@]}"; do
  [[ -n $only && $only != *",$s,"* ]] && continue
  [[ $skip == *",$s,"* ]] && continue
  step "$s"
done
echo "gpu-check: $((SECONDS - start)) s; results in $out_dir/gpu.md, logs in $out_dir/gpu-logs.tar.gz"
if ((${#failed[@]})); then
  echo "gpu-check: not passed: ${failed[*]}"
  exit 1
fi
echo "gpu-check: all passed"
