#!/usr/bin/env bash
# Where the threads of a dp = 2 run should sit on this machine's 2 cores, measured: `fsdpp run` on
# recipes/moe-small.json (global batch 32 x 128, 2 microbatches of 8 per rank) placed several ways
# (dist.cpu_binding, dist.compute_nice or dist.compute_policy=idle, dist.cpu_rotation_ms), and
# replicated (parallel.dp_replicate=2: each rank the whole model, gradients all-reduced),
# beside the communication-free limit: two independent one-rank runs of half the batch each
# (parallel.dp=1, global batch 16, the same microbatches), started together, no collectives at all.
# Rounds alternate the placements so that a busy machine slows all alike; figures are medians.
# Beside them, the bound left by the communication threads' CPU time and by a barrier per step
# under the machine's step-to-step jitter (the communication-free runs' step times, paired).
# Writes bench/results/dp2_threads.md, or the file given third; the report names the CPU.
#   bash bench/run_dp2_threads_bench.sh [build-dir] [rounds] [output]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-3}
python=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python
fsdpp=$(realpath "$build/fsdpp")
out=${3:-bench/results/dp2_threads.md}
source bench/cpuinfo.sh
cpu=$(cpuinfo 'model name')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
warmup=5
steps=20
results=$work/results.txt
# The rotation period of moe-small's own placement, for the rotating row.
rotation=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["dist"]["cpu_rotation_ms"])' recipes/moe-small.json)
# and its computing threads' scheduling class, for the summary of its placement
policy=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["dist"].get("compute_policy", "normal"))' \
  recipes/moe-small.json)
: > "$results"
# Every step logged: the communication-free runs' step times are paired step by step below. The
# computing threads stay where they are placed unless a run asks for rotation (dist.cpu_rotation_ms).
common=(eval.interval=0 checkpoint.interval=0 logging.interval=1 logging.plot=false --overwrite
        --stop-after $((warmup + steps)) dist.cpu_rotation_ms=0)

rate() {  # tokens/s of one run directory between the warm-up and the last step
  "$python" bench/metrics_tokens_per_s.py "$1/metrics/rank0.jsonl" $warmup $((warmup + steps)) "$2" | cut -d' ' -f1
}

# dp = 2: `fsdpp run` with recipe overrides, each rank's threads watched by bench/thread_cpu.py.
dp2() {
  local name=$1; shift
  local dir=$work/$name
  "$python" bench/thread_cpu.py "$dir.threads.json" "$fsdpp" run recipes/moe-small.json "${common[@]}" "$@" \
    logging.output_dir="$dir" > "$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
  echo "$name $(rate "$dir" $((32 * 128))) $(threads "$dir.threads.json")" >> "$results"
}

# The computing thread's time (each rank's first thread; both ranks together), as fractions of the
# time it was seen: running, waiting for a CPU, blocked; and the share of the ranks' CPU time that
# went to their other threads (communication and the runtime's).
threads() {
  "$python" - "$1" <<'PY'
import json, sys
ranks = json.load(open(sys.argv[1])).values()
main = [min(r, key=lambda t: t["tid"]) for r in ranks]
seen = sum(t["seen_s"] for t in main)
run, runq = sum(t["run_s"] for t in main), sum(t["runq_s"] for t in main)
cpu = sum(t["cpu_s"] for r in ranks for t in r)
print(f"{run / seen:.4f} {runq / seen:.4f} {(seen - run - runq) / seen:.4f} {(cpu - sum(t['cpu_s'] for t in main)) / cpu:.4f}")
PY
}

# Two one-rank runs of half the batch each, started together, one thread each; their rates add
# up. $2 = pin: each on its own CPU (taskset); nice: each at dist.compute_nice=19; idle: each in
# dist.compute_policy=idle. Every run here names its placement: the recipe's own (dist) would apply
# otherwise.
comm_free() {
  local name=$1 pin=$2
  local pids=()
  for r in 0 1; do
    local wrap="" nice=0 policy=normal
    [ "$pin" = pin ] && wrap="taskset -c $r"
    [ "$pin" = nice ] && nice=19
    [ "$pin" = idle ] && policy=idle
    OMP_NUM_THREADS=1 $wrap "$fsdpp" run recipes/moe-small.json parallel.dp=1 train.global_batch=16 "${common[@]}" \
      dist.cpu_binding=none dist.compute_nice=$nice dist.compute_policy=$policy logging.output_dir="$work/$name-$r" \
      > "$work/$name-$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$work/$name"-*.log; exit 1; }; done
  echo "$name $("$python" -c 'import sys; print(sum(map(float, sys.argv[1:])))' \
    "$(rate "$work/$name-0" $((16 * 128)))" "$(rate "$work/$name-1" $((16 * 128)))") $(barrier "$work/$name")" >> "$results"
}

# What a barrier at the end of every step would have cost these two independent runs: their step
# times (steps 6-25) paired by step, the mean of the slower of each pair over the mean of both.
# dp = 2 ranks cannot run ahead of each other by more than a step; each waits for the slower.
barrier() {
  "$python" - "$1-0/metrics/rank0.jsonl" "$1-1/metrics/rank0.jsonl" $warmup $((warmup + steps)) <<'PY'
import json, sys
a, b = int(sys.argv[3]), int(sys.argv[4])
def steps(path):
    t = {r["step"]: r["time_s"] for r in map(json.loads, open(path)) if "time_s" in r}
    return [t[i + 1] - t[i] for i in range(a, b)]
x, y = steps(sys.argv[1]), steps(sys.argv[2])
print(f"{sum(map(max, x, y)) / ((sum(x) + sum(y)) / 2):.4f}")
PY
}

# Placements: dist.cpu_binding / dist.compute_nice (dist.compute_policy normal).
normal=(dist.compute_policy=normal)
idle=(dist.compute_nice=0 dist.compute_policy=idle)
once=(none/0 rank/0 compute/0 none/19 compute/19)  # gathered once per step
again=(none/0 compute/0 compute/19)                # reshard after forward
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  comm_free comm-free-none ""
  comm_free comm-free-pinned pin
  comm_free comm-free-nice nice
  comm_free comm-free-idle idle
  for p in "${once[@]}"; do
    dp2 "dp2-false-${p%/*}-${p#*/}" parallel.reshard_after_forward=false dist.cpu_binding=${p%/*} dist.compute_nice=${p#*/} \
      "${normal[@]}"
  done
  for p in "${again[@]}"; do
    dp2 "dp2-true-${p%/*}-${p#*/}" parallel.reshard_after_forward=true dist.cpu_binding=${p%/*} dist.compute_nice=${p#*/} \
      "${normal[@]}"
  done
  dp2 dp2-false-rotate parallel.reshard_after_forward=false dist.cpu_binding=compute dist.compute_nice=19 \
    dist.compute_policy=normal dist.cpu_rotation_ms="$rotation"
  dp2 dp2-false-idle parallel.reshard_after_forward=false dist.cpu_binding=compute "${idle[@]}"
  dp2 dp2-false-idle-rotate parallel.reshard_after_forward=false dist.cpu_binding=compute dist.compute_nice=0 \
    dist.compute_policy=idle dist.cpu_rotation_ms="$rotation"
  dp2 dp2-false-bf16 parallel.reshard_after_forward=false dist.cpu_binding=compute dist.compute_nice=19 \
    "${normal[@]}" precision.reduce_dtype=bfloat16
  dp2 dp2-replicate-rank parallel.dp_replicate=2 parallel.reshard_after_forward=false dist.cpu_binding=rank \
    dist.compute_nice=0 "${normal[@]}"
  dp2 dp2-replicate-idle-rotate parallel.dp_replicate=2 parallel.reshard_after_forward=false dist.cpu_binding=compute \
    dist.compute_nice=0 dist.compute_policy=idle dist.cpu_rotation_ms="$rotation"
  OMP_NUM_THREADS=2 dp2 dp2-false-omp2 parallel.reshard_after_forward=false dist.cpu_binding=none dist.compute_nice=0 \
    "${normal[@]}"
done

"$python" - "$results" "$build" "$rounds" "${3:-}" "$cpu" "$rotation" "$policy" > "$out.tmp" <<'PY'
import datetime, statistics, sys
from collections import defaultdict
runs, split = defaultdict(list), defaultdict(list)
barrier = defaultdict(list)
for line in open(sys.argv[1]):
    name, value, *extra = line.split()
    runs[name].append(float(value))
    if len(extra) == 1:
        barrier[name].append(float(extra[0]))
    elif extra:
        split[name].append([float(x) for x in extra])
med = {k: statistics.median(v) for k, v in runs.items()}
build, rounds = sys.argv[2], sys.argv[3]
# Each run against the same round's limit (the best communication-free placement), side by side.
comm_free = ("comm-free-none", "comm-free-pinned", "comm-free-nice", "comm-free-idle")
limits = [max(r) for r in zip(*(runs[k] for k in comm_free))]
def bound(name):  # 1 - the others' share of the ranks' CPU, median over rounds
    return 1 - statistics.median(s[3] for s in split[name])
def barrier_cost(factors):  # the slower-over-mean factors of paired step times, as a loss
    return 1 - 1 / statistics.median(factors)
share = {k: statistics.median(x / l for x, l in zip(v, limits)) for k, v in runs.items()}
print("# dp = 2 on 2 cores: where the threads run, and the communication-free limit")
print()
extra = f" {sys.argv[4]}" if sys.argv[4] else ""
print(f"Command: `bash bench/run_dp2_threads_bench.sh {build} {rounds}{extra}` ({datetime.date.today()}), 2 cores "
      f"of {sys.argv[5]}, OPENBLAS_* as set by the machine.")
print()
print("`fsdpp run recipes/moe-small.json` (moe-small's model, global batch 32 x 128 tokens, 2 microbatches")
print("of 8 sequences per rank, AdamW, clipping; metrics and progress included) at dp = 2, one compute")
print("thread per rank (the launcher's OMP_NUM_THREADS=1). Beside it, the communication-free limit: two")
print("independent one-rank runs of half the batch each (`parallel.dp=1 train.global_batch=16`, one")
print("thread each), started together, their rates added: the same compute with no collectives at all.")
print("Tokens/s over steps 6-25, median over interleaved rounds. \"Of the limit\": each run divided by its")
print("round's limit (the best of the four communication-free placements), median over rounds.")
print()
print("Each rank has three kinds of threads: the one that computes (forward, backward, optimizer; no")
print("OpenMP pool at one thread), one worker per communicator that runs its collectives in order, and")
print("Gloo's event loop that moves the bytes. `dist.cpu_binding` decides where they run:")
print("`none` leaves them to the kernel, `rank` binds all of a rank's threads to its CPU, `compute`")
print("binds only the computing thread, so a rank's communication threads can run on the other CPU")
print("while its own CPU computes. `dist.compute_nice` adds to the computing thread's nice value (0:")
print("off); the communication threads keep nice 0, so they run as soon as bytes arrive or can leave")
print("instead of when a computing thread's time slice ends. `dist.compute_policy=idle` puts the")
print("computing thread in Linux's SCHED_IDLE class instead: a communication thread that wakes on its")
print("CPU takes it at once, where at nice 19 it may still wait for the scheduler's next decision (up to")
print("a time slice). `parallel.reshard_after_forward` decides")
print("how often blocks are gathered: `true` frees them after forward and gathers again for backward")
print("(4 all-gathers per block per step with 2 microbatches), `false` gathers each block once per step")
print("and keeps it through both microbatches (1 all-gather per block per step, as much traffic as")
print("DDP's all-reduce).")
print()
print("Each dp = 2 run's threads are watched from /proc (`bench/thread_cpu.py`, a reading every 0.2 s,")
print("the whole run: start-up, 25 steps, the end). The computing threads' time, both ranks together,")
print("is split into running, waiting for a CPU (runnable, another thread on it) and blocked (waiting")
print("for a collective or a lock); \"others' CPU\" is the share of the ranks' CPU time that their other")
print("threads took (communication, the runtime's). Each a median over rounds.")
print()
print("\"Others' CPU\" bounds a run: if both CPUs never idled, the computing threads would get at most")
print("1 - (others' share) of them, against all of them in the communication-free runs. \"A barrier")
print("per step\" (communication-free rows) is what waiting at the end of every step for the slower of")
print("the two runs would have cost them: their step times paired by step, the mean of the slower over")
print("the mean of both, as a loss (median over rounds). A dp = 2 step waits so at least once, for")
print("its gradients; it cannot avoid the machine's step-to-step jitter that this measures.")
print()
print("| run | tokens/s (median) | of the limit | computing: running | waiting for a CPU | blocked | others' CPU | bound: 1 - others' CPU | a barrier per step | rounds (tokens/s) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
def row(label, name):
    cells = ["", "", "", "", "", ""]
    if split[name]:
        cells = [f"{100 * statistics.median(s[i] for s in split[name]):.1f}%" for i in range(4)]
        cells += [f"{bound(name):.2f}x", ""]
    if barrier[name]:
        cells[5] = f"{100 * barrier_cost(barrier[name]):.1f}%"
    print(f"| {label} | {med[name]:.0f} | {share[name]:.2f}x | {' | '.join(cells)} | {' '.join(f'{x:.0f}' for x in runs[name])} |")
row("communication-free, unbound", "comm-free-none")
row("communication-free, each run on its own CPU", "comm-free-pinned")
row("communication-free, each run at compute_nice 19", "comm-free-nice")
row("communication-free, each run in compute_policy idle", "comm-free-idle")
for g, what in (("false", "gathered once per step"), ("true", "reshard after forward")):
    for name in sorted((n for n in runs if n.startswith(f"dp2-{g}-") and n not in ("dp2-false-omp2", "dp2-false-bf16", "dp2-false-rotate", "dp2-false-idle", "dp2-false-idle-rotate")),
                       key=lambda n: (int(n.rsplit("-", 1)[1]), ("none", "rank", "compute").index(n.split("-")[2]))):
        _, _, b, nice = name.split("-")
        row(f"dp = 2, {what}, cpu_binding {b}, compute_nice {nice}", name)
rotation = sys.argv[6]
row(f"dp = 2, gathered once per step, cpu_binding compute, compute_nice 19, computing threads rotating every {rotation} ms", "dp2-false-rotate")
row("dp = 2, gathered once per step, cpu_binding compute, compute_policy idle", "dp2-false-idle")
row(f"dp = 2, gathered once per step, cpu_binding compute, compute_policy idle, computing threads rotating every {rotation} ms", "dp2-false-idle-rotate")
row("dp = 2, gathered once per step, cpu_binding compute, compute_nice 19, gradients reduced in bfloat16", "dp2-false-bf16")
row("dp = 2, gathered once per step, 2 OpenMP threads per rank, unbound", "dp2-false-omp2")
row("dp = 2 replicated, cpu_binding rank, compute_nice 0", "dp2-replicate-rank")
row(f"dp = 2 replicated, cpu_binding compute, compute_policy idle, computing threads rotating every {rotation} ms", "dp2-replicate-idle-rotate")
print()
print("With 2 OpenMP threads per rank, the second one's time counts among the others'. Gradients reduced")
print("in bfloat16 (`precision.reduce_dtype=bfloat16`; parameters, gradients and the optimizer stay in")
print("float32): the reduce-scatter carries half the bytes at 2 ranks, and each gradient is rounded to")
print("bfloat16 before the sum and after it; a different computation, shown for what the bytes cost.")
print(f"Rotating (`dist.cpu_rotation_ms={rotation}`, recipes/moe-small.json's; Note [rotating CPUs] in")
print(f"include/fsdpp/base/cpu_binding.hpp): every {rotation} ms the two ranks' computing threads swap CPUs, at the same instants.")
print("Replicated (`parallel.dp_replicate=2`): HSDP with shard groups of one rank, so each rank holds the")
print("whole model, its gradients and its optimizer state, as DDP does (twice the sharded runs' memory")
print("for them), and a unit's gradients are averaged by one all-reduce of its bytes, where the sharded")
print("runs reduce-scatter them and all-gather the parameters (the same bytes on the wire at 2 ranks);")
print("its all-gathers are local, one copy from the shard into the parameters (Note [one-rank buffers]")
print("in src/fsdp/param_group.cpp).")
idle = sys.argv[7] == "idle"  # moe-small's placement
name, how = ("dp2-false-idle-rotate", "compute_policy idle") if idle else ("dp2-false-rotate", "nice 19")
cost = barrier_cost([x for k in comm_free for x in barrier[k]])
print()
print(f"moe-small's placement (gathered once, `compute`, {how}, rotating every {rotation} ms): the others' CPU bounds it at {bound(name):.3f}x;")
print(f"a barrier per step with this machine's jitter costs {100 * cost:.1f}% (median over every")
print(f"communication-free pair); both together leave {bound(name) * (1 - cost):.3f}x. Measured: {share[name]:.3f}x.")
PY
mv "$out.tmp" "$out"
cat "$out"
