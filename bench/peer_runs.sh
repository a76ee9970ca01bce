# Sourced by the scripts that put fsdpp beside PyTorch (bench/run_pytorch_bench.sh,
# bench/run_pytorch_bf16_bench.sh), once build, fsdpp, python and work are set: each run of
# fsdpp_run and torch_run appends "NAME TOKENS_PER_S" to $results, measured over `steps` steps after
# `warmup`; `peer` runs bench/torch_peer.py, `$same $peer` on fsdpp's kernels.
warmup=5
steps=20
results=$work/results.txt
: > "$results"
peer="$python bench/torch_peer.py"
# PyTorch on the kernels fsdpp's command line runs: libfsdpp_mkl_kernels.so preloaded makes MKL
# choose for PyTorch as it does for `fsdpp run` (Note [MKL's kernels on other vendors' CPUs]).
same="env LD_PRELOAD=$(realpath "$build/libfsdpp_mkl_kernels.so")"

# fsdpp: tokens/s over steps warmup+1 .. warmup+steps, from the run's metrics (time_s at both ends).
fsdpp_run() {
  local name=$1 recipe=$2; shift 2
  local dir=$work/$name
  "$fsdpp" run "$recipe" "$@" eval.interval=0 checkpoint.interval=0 logging.interval=$warmup logging.plot=false \
    logging.output_dir="$dir" --overwrite --stop-after $((warmup + steps)) > "$dir.log" 2>&1 ||
    { cat "$dir.log"; exit 1; }
  echo "$name $("$python" bench/metrics_tokens_per_s.py "$dir/metrics/rank0.jsonl" $warmup $((warmup + steps)) $((32 * 128)) | cut -d' ' -f1)" >> "$results"
}

torch_run() {
  local name=$1; shift
  "$@" 2>"$work/$name.err" | sed -n 's/^\(\[rank[0-9]\]: \)\{0,1\}{/{/p' | "$python" -c '
import json, sys
for line in sys.stdin:
    print(sys.argv[1], json.loads(line)["tokens_per_s"])' "$name" >> "$results" ||
    { cat "$work/$name.err"; exit 1; }
}
