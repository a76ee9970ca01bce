#!/usr/bin/env bash
# The GPU check: everything one GPU can prove, on a lent machine (NVIDIA GPU, CUDA toolkit, cmake,
# ninja, g++, Python with PyTorch 2.11 or newer, whose wheel brings LibTorch and NCCL; no Debian
# packages, no network). What else it needs comes in a folder that scripts/gpu-deps.sh makes on a
# machine with Debian's packages (header-only libraries and the fortunes corpus; no binary library,
# so the machine's C library may be older than Debian's).
#
#   scripts/gpu-check.sh --quick [--deps DIR] [--build-dir DIR] [--budget SECONDS]
#   scripts/gpu-check.sh --rest  [...]      the steps --quick leaves, on the same build, right after
#   scripts/gpu-check.sh [--only a,b] [--skip a,b] [...]     every step
#   scripts/gpu-check.sh --dry-run [--build-dir build] ...   the same plumbing on the CPU, here
#
# A lent machine gives about 15 minutes in all, a start of 2-4 minutes included, at most 10 minutes
# a command, and is kept between commands only briefly: run --quick (the build, then the core in
# about 3 minutes) and at once --rest. The default budget (540 s) fits one command.
#
# Steps, in order (each under its own timeout, cut to what is left of the budget):
#   build           configure and build the GPU targets against the machine's PyTorch    (quick)
#   collectives_w1  every collective and grouped send/recv, float32 and bfloat16, at     (quick)
#   collectives_w2  world 1 and 2 (2 processes sharing the GPU: fsdpp launch --share-gpu),(quick)
#                   then captured and replayed
#   graph_pp1       moe-small, 2 microbatches: CUDA graph replay bitwise equal to eager  (quick)
#   graph_pp2_1f1b  pp = 2, 1F1B, 4 microbatches, max_outstanding_sends = 2: the same     (quick)
#   nccl_core       the NCCL core alone (tests/comm/test_nccl_core.cpp)
#   gpu_tests       tests/gpu/test_gpu.cpp: collectives, the watchdog after a capture, a failed
#                   capture, fully_shard on CUDA, a captured MoE step bitwise equal to eager
#   graph_pp2_v     pp = 2, ZBVZeroBubble (2 stages per rank): the same
#   parallel        dp = 2, dp = 2 with ep = 2, and pp = 2 against world 1, eager, within 1e-5
#   speed_small     moe-small, eager against graph replay (from graph_pp1's runs)
#   big_fsdpp       16 experts top-2 bfloat16 (configs/moe-16x2.json), fsdpp with a CUDA graph
#   big_torch       the same model, batch and GPU under PyTorch's own fully_shard (runs whether
#                   or not big_fsdpp passed), then tokens/s and MFU of both
#
# After every step, $OUT (the device tool's return folder; default BUILD_DIR/gpu-out) holds two
# files: gpu.md (the results so far) and gpu-logs.tar.gz (every step's log, with NCCL's warnings
# (NCCL_DEBUG=WARN), the flight records of any rank whose watchdog fired, and the runs' metrics). A
# hang costs only its own step; a step that cannot fit in what is left of the budget is reported as
# not run. Exit status 0 when every step that ran passed.
#
# --dry-run runs the same steps on the CPU with the CPU build (Gloo under the NCCL-order check, no
# capture, fewer steps), so that the plumbing (timeouts, comparisons, reports, archive) is tested
# here (test scripts.gpu_check). FSDPP_GPU_CHECK_HANG=STEP:SECONDS makes STEP hang under a limit of
# SECONDS (to test timeouts).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
self=$root/scripts/gpu-check.sh

if [[ ${1:-} != _step ]]; then  # `_step NAME` (see step()) inherits the settings below
  deps=.deps/gpu build_dir="" budget=540 dry=0 only="" skip="" mode=all
  while (($#)); do
    case $1 in
      --quick) mode=quick; shift ;;
      --rest) mode=rest; shift ;;
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
  # The Python whose PyTorch the build uses: FSDPP_PYTHON, else the first of these that imports
  # PyTorch 2.11 or newer (a machine may have several interpreters, not all with torch).
  torch_ok='import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))'
  candidates=(python3 python python3.12 python3.13 python3.11)
  [[ $dry == 1 ]] && candidates=("${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python" "${candidates[@]}")
  [[ -n ${FSDPP_PYTHON:-} ]] && candidates=("$FSDPP_PYTHON")
  python=""
  for c in "${candidates[@]}"; do
    c=$(command -v "$c" 2>/dev/null) || continue
    "$c" -c "$torch_ok" 2>/dev/null && { python=$c; break; }
  done
  if [[ -z $python ]]; then
    echo "gpu-check: no Python that imports PyTorch 2.11 or newer among: ${candidates[*]} (set FSDPP_PYTHON)" >&2
    exit 2
  fi
  bin=$build_dir/fsdpp
  runs=$work/runs
  # The corpus the recipes train on comes in the dependency folder (no Debian package there).
  [[ $dry == 0 && -d $deps/fortunes && -z ${FSDPP_FORTUNES_DIR:-} ]] && export FSDPP_FORTUNES_DIR=$(cd "$deps/fortunes" && pwd)
  # What a failure leaves behind: NCCL's warnings in each step's log (and the flight records of a
  # rank whose watchdog fires, see step()).
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export deps build_dir work runs python bin dry mode
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
  # --quick: 10 steps (3 eager, the capture, 6 replays); otherwise 30.
  local steps=30
  [[ $mode == quick ]] && steps=10
  [[ $dry == 1 ]] && steps=4
  # The watchdog fires before the step's timeout, so that a hang leaves its flight records.
  "$bin" run "$recipe" train.steps=$steps eval.interval=0 eval.batches=1 checkpoint.enabled=false logging.interval=1 \
    logging.plot=false logging.output_dir="$runs/$name" dist.watchdog_timeout_s="${watchdog_s:-60}" "$@" \
    "${device[@]}" --overwrite
}
report() { "$python" "$root/scripts/gpu_check_report.py" "$@"; }

step_build() {
  [[ $dry == 1 ]] && { ls -l "$bin" "$build_dir/tests/fsdpp_test_rank"; return; }
  local cuda torch_prefix nccl_root nccl_inc nccl_lib nccl_so
  cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
  [[ -f $cuda/include/cuda_runtime.h ]] || { echo "no CUDA toolkit at $cuda (set CUDA_HOME)"; return 1; }
  torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 1
  echo "Python $python, PyTorch $("$python" -c 'import torch; print(torch.__version__)')"
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
  local targets=(fsdpp_cli fsdpp_test_gpu_ranks)
  [[ $mode != quick ]] && targets+=(fsdpp_test_gpu fsdpp_test_nccl_core)
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDPP_PYTHON="$python" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_INCLUDE_PATH="$deps_abs/include" \
    -DCUDAToolkit_ROOT="$cuda" -DFSDPP_WITH_NCCL=ON -DFSDPP_WITH_GLOO=OFF -DFSDPP_WITH_SENTENCEPIECE=OFF -DFSDPP_WITH_TOKENIZER_JSON=OFF \
    -DFSDPP_BUILD_BENCH=OFF \
    -DNCCL_INCLUDE_DIR="$nccl_inc" -DNCCL_LIBRARY="$nccl_so" &&
    ninja -C "$build_dir" -j"$(nproc)" "${targets[@]}" &&
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
  # On the CPU the same checks (tests/gpu/collectives.hpp) run under NCCL's ordering rules.
  [[ $dry == 1 ]] && program=(env FSDPP_CHECK_NCCL_ORDER=1 "$build_dir/tests/fsdpp_test_rank" collectives)
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
  fsdpp_run pp2 "${common[@]}" parallel.dp=1 parallel.pp=2 parallel.microbatches=4 train.grad_accum=1 --share-gpu &&
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
quick_steps=(build collectives_w1 collectives_w2 graph_pp1 graph_pp2_1f1b)
rest_steps=(build nccl_core gpu_tests graph_pp2_v parallel speed_small big_fsdpp big_torch)
case $mode in
  quick) steps=("${quick_steps[@]}") ;;
  rest) steps=("${rest_steps[@]}") ;;
  *) steps=("${quick_steps[@]}" "${rest_steps[@]:1}") ;;
esac
declare -A limit=([build]=330 [collectives_w1]=45 [collectives_w2]=60 [graph_pp1]=75 [graph_pp2_1f1b]=90
                  [nccl_core]=45 [gpu_tests]=120 [graph_pp2_v]=100 [parallel]=150 [speed_small]=30
                  [big_fsdpp]=120 [big_torch]=120)
declare -A needs=([build]=60 [big_torch]=30)  # the least worth starting with; others 20 s
start=$SECONDS
out_dir=${OUT:-$build_dir/gpu-out}
# --rest continues the report and the runs of --quick (speed_small reads graph_pp1's runs).
[[ $mode == rest && -f $work/table.md ]] || rm -rf "$work"
mkdir -p "$work/logs" "$runs" "$out_dir"
failed=()
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
flags=$([[ $mode != all ]] && echo " --$mode")$([[ $dry == 1 ]] && echo " --dry-run")
if [[ ! -f $work/table.md ]]; then
  {
    echo "# GPU check"
    echo
    echo "Machine: ${gpu:-no GPU (dry run on $(nproc) CPU cores)}; PyTorch ${torch_version:-?} ($python); $(date -u '+%Y-%m-%d %H:%M UTC')."
    echo "Command: \`bash scripts/gpu-check.sh$flags\` (logs: gpu-logs.tar.gz)."
  } > "$work/head.md"
  : > "$work/table.md"
  : > "$work/details.md"
else
  echo "Then: \`bash scripts/gpu-check.sh$flags\`, $(date -u '+%H:%M UTC')." >> "$work/head.md"
fi

deliver() {
  { cat "$work/head.md"; echo; echo "| step | result | seconds |"; echo "|---|---|---|"; cat "$work/table.md" "$work/details.md"; } > "$work/gpu.md"
  cp "$work/gpu.md" "$out_dir/gpu.md.tmp" && mv "$out_dir/gpu.md.tmp" "$out_dir/gpu.md"
  tar -czf "$out_dir/gpu-logs.tar.gz.tmp" -C "$work" logs runs && mv "$out_dir/gpu-logs.tar.gz.tmp" "$out_dir/gpu-logs.tar.gz"
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
  # A rank whose watchdog fires (before the step times out) writes its flight records here.
  FSDPP_FR_DUMP_DIR=$work/logs/flight-records-$name watchdog_s=$((lim > 45 ? lim - 25 : 20)) \
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
