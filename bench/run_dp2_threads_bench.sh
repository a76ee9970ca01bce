#!/usr/bin/env bash
# Where the threads of a dp = 2 run should sit on this machine's 2 cores, measured: `fsdpp run` on
# recipes/moe-small.json (global batch 32 x 128, 2 microbatches of 8 per rank) placed several ways,
# beside the communication-free limit: two independent one-rank runs of half the batch each
# (parallel.dp=1, global batch 16, the same microbatches), started together, no collectives at all.
# Rounds alternate the placements so that a busy machine slows all alike; figures are medians.
# Writes bench/results/dp2_threads.md.
#   bash bench/run_dp2_threads_bench.sh [build-dir] [rounds]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-3}
python=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python
fsdpp=$(realpath "$build/fsdpp")
out=bench/results/dp2_threads.md
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
warmup=5
steps=20
results=$work/results.txt
: > "$results"
common=(eval.interval=0 checkpoint.interval=0 logging.interval=$warmup logging.plot=false --overwrite
        --stop-after $((warmup + steps)))

rate() {  # tokens/s of one run directory between the warm-up and the last step
  "$python" bench/metrics_tokens_per_s.py "$1/metrics/rank0.jsonl" $warmup $((warmup + steps)) "$2" | cut -d' ' -f1
}

# dp = 2: `fsdpp run` with recipe overrides.
dp2() {
  local name=$1; shift
  local dir=$work/$name
  "$fsdpp" run recipes/moe-small.json "${common[@]}" "$@" logging.output_dir="$dir" > "$dir.log" 2>&1 ||
    { cat "$dir.log"; exit 1; }
  echo "$name $(rate "$dir" $((32 * 128)))" >> "$results"
}

# Two one-rank runs of half the batch each, started together, one thread each; their rates add
# up. $2 = pin: each on its own CPU (taskset).
comm_free() {
  local name=$1 pin=$2
  local pids=()
  for r in 0 1; do
    local wrap=""
    [ "$pin" = pin ] && wrap="taskset -c $r"
    OMP_NUM_THREADS=1 $wrap "$fsdpp" run recipes/moe-small.json parallel.dp=1 train.global_batch=16 "${common[@]}" \
      logging.output_dir="$work/$name-$r" > "$work/$name-$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$work/$name"-*.log; exit 1; }; done
  echo "$name $("$python" -c 'import sys; print(sum(map(float, sys.argv[1:])))' \
    "$(rate "$work/$name-0" $((16 * 128)))" "$(rate "$work/$name-1" $((16 * 128)))")" >> "$results"
}

gathers=(true false)
bindings=(none rank compute)
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  comm_free comm-free-none ""
  comm_free comm-free-pinned pin
  for g in "${gathers[@]}"; do
    for b in "${bindings[@]}"; do
      dp2 "dp2-$g-$b" parallel.reshard_after_forward=$g dist.cpu_binding=$b
    done
  done
  OMP_NUM_THREADS=2 dp2 dp2-false-omp2 parallel.reshard_after_forward=false
done

"$python" - "$results" "$build" "$rounds" > "$out.tmp" <<'PY'
import datetime, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    name, value = line.split()
    runs[name].append(float(value))
med = {k: statistics.median(v) for k, v in runs.items()}
build, rounds = sys.argv[2], sys.argv[3]
# Each run against the same round's limit (the better communication-free placement), side by side.
limits = [max(a, b) for a, b in zip(runs["comm-free-none"], runs["comm-free-pinned"])]
share = {k: statistics.median(x / l for x, l in zip(v, limits)) for k, v in runs.items()}
print("# dp = 2 on 2 cores: where the threads run, and the communication-free limit")
print()
print(f"Command: `bash bench/run_dp2_threads_bench.sh {build} {rounds}` ({datetime.date.today()}), 2 cores, "
      "OPENBLAS_* as set by the machine.")
print()
print("`fsdpp run recipes/moe-small.json` (moe-small's model, global batch 32 x 128 tokens, 2 microbatches")
print("of 8 sequences per rank, AdamW, clipping; metrics and progress included) at dp = 2, one compute")
print("thread per rank (the launcher's OMP_NUM_THREADS=1). Beside it, the communication-free limit: two")
print("independent one-rank runs of half the batch each (`parallel.dp=1 train.global_batch=16`, one")
print("thread each), started together, their rates added: the same compute with no collectives at all.")
print("Tokens/s over steps 6-25, median over interleaved rounds. \"Of the limit\": each run divided by its")
print("round's limit (the better of the two communication-free placements), median over rounds.")
print()
print("Each rank has three kinds of threads: the one that computes (forward, backward, optimizer; no")
print("OpenMP pool at one thread), one worker per communicator that runs its collectives in order, and")
print("Gloo's event loop that moves the bytes. `dist.cpu_binding` decides where they run:")
print("`none` leaves them to the kernel, `rank` binds all of a rank's threads to its CPU, `compute`")
print("binds only the computing thread, so a rank's communication threads can run on the other CPU")
print("while its own CPU computes. `parallel.reshard_after_forward` decides how often blocks are")
print("gathered: `true` frees them after forward and gathers again for backward (4 all-gathers per")
print("block per step with 2 microbatches), `false` gathers each block once per step and keeps it")
print("through both microbatches (1 all-gather per block per step, as much traffic as DDP's all-reduce).")
print()
print("| run | tokens/s (median) | of the limit | rounds |")
print("|---|---:|---:|---|")
def row(label, name):
    print(f"| {label} | {med[name]:.0f} | {share[name]:.2f}x | {' '.join(f'{x:.0f}' for x in runs[name])} |")
row("communication-free, unbound", "comm-free-none")
row("communication-free, each run on its own CPU", "comm-free-pinned")
for g, what in (("true", "reshard after forward"), ("false", "gathered once per step")):
    for b in ("none", "rank", "compute"):
        row(f"dp = 2, {what}, cpu_binding {b}", f"dp2-{g}-{b}")
row("dp = 2, gathered once per step, 2 OpenMP threads per rank, unbound", "dp2-false-omp2")
PY
mv "$out.tmp" "$out"
cat "$out"
