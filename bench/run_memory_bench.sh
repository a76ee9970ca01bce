#!/usr/bin/env bash
# Peak memory per rank, fsdpp beside PyTorch 2.15 on the same work: moe-small (configs/moe-small.json)
# under pp=2 (1F1B, Interleaved1F1B and ZBVZeroBubble, 4 microbatches of 8 x 128 tokens) and under
# dp=2 fully_shard (reshard_after_forward true and false, 2 accumulation microbatches), AdamW and
# clipping as bench/run_pytorch_bench.sh gives both. Each rank runs under bench/peak_rss.py, which
# reads the kernel's peak resident set of the rank's process the same way for both sides. Runs of
# 5 steps (peaks settle after the second); rounds alternate fsdpp and PyTorch. Writes
# bench/results/memory.md.
#   bash bench/run_memory_bench.sh [build-dir] [rounds] [output]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-2}
out=${3:-bench/results/memory.md}
source bench/peer_runs.sh
steps=5
peaks=$work/peaks.txt
: > "$peaks"

# measure NAME COMMAND...: the command on 2 ranks, each under peak_rss.py; appends "NAME RANK MIB".
measure() {
  local name=$1; shift
  : > "$work/$name.rss"
  "$fsdpp" launch --nproc 2 -- "$python" bench/peak_rss.py "$work/$name.rss" -- "$@" > "$work/$name.log" 2>&1 ||
    { tail -40 "$work/$name.log"; exit 1; }
  sed "s/^/$name /" "$work/$name.rss" >> "$peaks"
}
fsdpp_measure() {
  local name=$1 recipe=$2; shift 2
  measure "$name" "$fsdpp" run "$recipe" "$@" eval.interval=0 checkpoint.interval=0 logging.plot=false \
    logging.output_dir="$work/run-$name" --overwrite --stop-after $steps
}
torch_measure() {
  local name=$1; shift
  measure "$name" env LD_PRELOAD="$(realpath "$build/libfsdpp_mkl_kernels.so")" $peer "$@" --warmup 0 --steps $steps
}

for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  # Each side's libraries loaded and nothing trained: the floor under every row.
  RANK=0 "$python" bench/peak_rss.py "$work/floor-fsdpp.rss" -- "$fsdpp" schedule show --schedule 1F1B --pp 2 \
    --microbatches 4 > /dev/null
  RANK=0 "$python" bench/peak_rss.py "$work/floor-pytorch.rss" -- env LD_PRELOAD="$(realpath "$build/libfsdpp_mkl_kernels.so")" \
    "$python" -c "import torch, torch.distributed.pipelining, torch.distributed.fsdp; torch.ones(1).sum()"
  for schedule in 1F1B Interleaved1F1B ZBVZeroBubble; do
    per_rank=$([[ $schedule == 1F1B ]] && echo 1 || echo 2)
    fsdpp_measure "fsdpp-pp2-$schedule" recipes/moe-small-pp.json parallel.schedule=$schedule \
      parallel.stages_per_rank=$per_rank
    torch_measure "pytorch-pp2-$schedule" pp --microbatches 4 --schedule $schedule
  done
  fsdpp_measure fsdpp-dp2-reshard recipes/moe-small.json parallel.reshard_after_forward=true
  torch_measure pytorch-dp2-reshard train --mode fsdp --accum 2
  fsdpp_measure fsdpp-dp2-kept recipes/moe-small.json
  torch_measure pytorch-dp2-kept train --mode fsdp --accum 2 --reshard-after-forward false
done

# What lazy receive buffers and output release save on these schedules, from the plans: receive
# buffers live at once against one per RECV of the step (all allocated up front), and forward
# outputs live at once against every output kept until its backward.
for schedule in 1F1B Interleaved1F1B ZBVZeroBubble; do
  per_rank=$([[ $schedule == 1F1B ]] && echo 1 || echo 2)
  "$fsdpp" schedule show --schedule $schedule --pp 2 --microbatches 4 --stages-per-rank $per_rank \
    --max-outstanding-sends 2 --out "$work/plan-$schedule" > "$work/plan-$schedule.txt"
done

"$python" - "$peaks" "$work" "$build" "$rounds" "${3:-}" "$cpu" > "$out.tmp" <<'PY'
import datetime, glob, json, os, re, statistics, subprocess, sys
from collections import defaultdict
import torch
peaks_file, work, build, rounds, out_arg, cpu = sys.argv[1:7]
peaks = defaultdict(lambda: defaultdict(list))  # name -> rank -> MiB per round
for line in open(peaks_file):
    name, rank, mib = line.split()
    peaks[name][int(rank)].append(float(mib))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print("# Peak memory per rank: fsdpp and PyTorch 2.15 side by side\n")
print(f"{datetime.date.today()}, {cpu}, 2 ranks on this machine, commit {commit}, torch {torch.__version__}.")
print("Command: `bash bench/run_memory_bench.sh " + " ".join(x for x in [build, rounds, out_arg] if x) + "`.\n")
print("moe-small (4 layers, dim 128, 4 experts; 1.4 M parameters), global batch 32 x 128 tokens, float32, AdamW,")
print("5 steps. Each rank's process runs under `bench/peak_rss.py`: its peak resident set (ru_maxrss, anonymous and")
print("file pages: the libraries' code counts on both sides). Median over the rounds; the rounds' range in brackets.\n")
def floor(side):
    return statistics.median(float(line.split()[1]) for line in open(os.path.join(work, f"floor-{side}.rss")))
floors = {"fsdpp": floor("fsdpp"), "pytorch": floor("pytorch")}
print(f"The floor under each side, its libraries loaded and nothing trained (`fsdpp schedule show`; python importing")
print(f"torch, torch.distributed.pipelining and torch.distributed.fsdp): fsdpp {floors['fsdpp']:.0f} MiB, PyTorch")
print(f"{floors['pytorch']:.0f} MiB. Most of each row is that floor; the last column compares what training adds to it.\n")
print("| work | fsdpp rank 0 / rank 1 MiB | PyTorch rank 0 / rank 1 MiB | fsdpp / PyTorch (higher rank) | above the floor: fsdpp / PyTorch MiB |")
print("|---|---|---|---|---|")
def cell(name):
    ranks = peaks[name]
    return " / ".join(f"{statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]" for _, v in sorted(ranks.items()))
def top(name):
    return max(statistics.median(v) for v in peaks[name].values())
rows = [("pp=2 1F1B", "pp2-1F1B"), ("pp=2 Interleaved1F1B (2 stages per rank)", "pp2-Interleaved1F1B"),
        ("pp=2 ZBVZeroBubble (2 stages per rank)", "pp2-ZBVZeroBubble"),
        ("dp=2 fully_shard, reshard_after_forward true", "dp2-reshard"),
        ("dp=2 fully_shard, reshard_after_forward false", "dp2-kept")]
for label, key in rows:
    f, p = f"fsdpp-{key}", f"pytorch-{key}"
    print(f"| {label} | {cell(f)} | {cell(p)} | {top(f) / top(p):.2f} | {top(f) - floors['fsdpp']:.0f} / {top(p) - floors['pytorch']:.0f} |")
print("\nLazy receive buffers and output release (always on in fsdpp), from the plans (`fsdpp schedule show`,")
print("max_outstanding_sends 2): one receive buffer or stage output is 8 x 128 x 128 float32 = 0.5 MiB.\n")
print("| schedule | rank | receive buffers live at most / RECVs in the step | stage outputs live at most (released after send: 0) |")
print("|---|---|---|---|")
mib = 8 * 128 * 128 * 4 / 2**20
for schedule in ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"]:
    text = open(os.path.join(work, f"plan-{schedule}.txt")).read()
    lowered = open(os.path.join(work, f"plan-{schedule}.csv")).read().splitlines()
    for m in re.finditer(r"rank (\d+): \d+ actions after lowering, peak live activations (\d+), peak receive buffers (\d+)", text):
        r, acts, bufs = int(m[1]), int(m[2]), int(m[3])
        cells = lowered[r].split(",") if r < len(lowered) else []
        recvs = sum(1 for c in cells if "RECV" in c)
        print(f"| {schedule} | {r} | {bufs} / {recvs} ({bufs * mib:.1f} / {recvs * mib:.1f} MiB) | {acts} ({acts * mib:.1f} MiB) |")
PY
mv "$out.tmp" "$out"
cat "$out"
