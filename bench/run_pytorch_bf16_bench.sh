#!/usr/bin/env bash
# fsdpp beside PyTorch 2.15 in bfloat16, on the same work as bench/run_pytorch_bench.sh (moe-small's
# model, global batch 32 x 128 tokens, AdamW, clipping at 1.0, the fortunes corpus): fsdpp with
# precision.param_dtype=bfloat16 (float32 reduction, parameters and optimizer), PyTorch with
# fully_shard's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) at dp 2 and
# torch.autocast("cpu", bfloat16) for DDP and eager (bench/torch_peer.py --dtype bfloat16); float32
# runs of both beside them. PyTorch runs on the MKL kernels fsdpp runs (bench/peer_runs.sh). Rounds alternate the implementations; each figure is the median over
# rounds, each ratio the median of the rounds' ratios. Writes bench/results/pytorch_bf16.md.
#   bash bench/run_pytorch_bf16_bench.sh [build-dir] [rounds]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-4}
source bench/preamble.sh
out=bench/results/pytorch_bf16.md
source bench/peer_runs.sh
bf16=precision.param_dtype=bfloat16
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  fsdpp_run fsdpp-dp2-bf16 recipes/moe-small.json $bf16
  torch_run pytorch-fsdp-dp2-kept-bf16 "$fsdpp" launch --nproc 2 -- $same $peer train --mode fsdp --dtype bfloat16 \
    --reshard-after-forward false --accum 2 --warmup $warmup --steps $steps
  torch_run pytorch-ddp-dp2-bf16 "$fsdpp" launch --nproc 2 -- $same $peer train --mode ddp --dtype bfloat16 --accum 2 \
    --warmup $warmup --steps $steps
  fsdpp_run fsdpp-dp1-bf16 recipes/moe-small.json parallel.dp=1 $bf16
  fsdpp_run fsdpp-dp1-threads-bf16 recipes/moe-small.json parallel.dp=1 cpu.microbatch_threads=2 $bf16
  fsdpp_run fsdpp-dp1-threads recipes/moe-small.json parallel.dp=1 cpu.microbatch_threads=2
  torch_run pytorch-eager-dp1-bf16 $same $peer train --mode eager --dtype bfloat16 --threads 2 --accum 2 --warmup $warmup \
    --steps $steps
  torch_run pytorch-eager-dp1 $same $peer train --mode eager --threads 2 --accum 2 --warmup $warmup --steps $steps
done

"$python" - "$results" "$build" "$rounds" "$cpu" > "$out.tmp" <<'PY'
import collections, datetime, statistics, sys
path, build, rounds, cpu = sys.argv[1:]
runs = collections.defaultdict(list)
for line in open(path):
    name, tps = line.split()
    runs[name].append(float(tps))
LABELS = {
    "fsdpp-dp2-bf16": "fsdpp dp=2, bfloat16 (`recipes/moe-small.json precision.param_dtype=bfloat16`)",
    "pytorch-fsdp-dp2-kept-bf16": "PyTorch `fully_shard` dp=2, MixedPrecisionPolicy(bfloat16, float32), each block gathered once per step",
    "pytorch-ddp-dp2-bf16": "PyTorch DDP dp=2, autocast bfloat16",
    "fsdpp-dp1-bf16": "fsdpp dp=1, bfloat16 (2 microbatches of 16, 2 threads)",
    "fsdpp-dp1-threads-bf16": "fsdpp dp=1, bfloat16, `cpu.microbatch_threads=2`",
    "fsdpp-dp1-threads": "fsdpp dp=1, float32, `cpu.microbatch_threads=2`",
    "pytorch-eager-dp1-bf16": "PyTorch eager, one process, 2 threads, autocast bfloat16",
    "pytorch-eager-dp1": "PyTorch eager, one process, 2 threads, float32",
}
def ratio(a, b):
    r = [x / y for x, y in zip(runs[a], runs[b])]
    return f"**{statistics.median(r):.2f}x** (rounds {', '.join(f'{v:.2f}' for v in r)})"
print("# fsdpp beside PyTorch 2.15 in bfloat16")
print()
print(f"Command: `bash bench/run_pytorch_bf16_bench.sh {build} {rounds}` ({datetime.date.today()}), 2 cores of {cpu}, "
      "OPENBLAS_* as set by the machine.")
print()
print("The same work as `bench/results/pytorch.md` (moe-small's model, global batch 32 x 128 tokens, AdamW,")
print("clipping at 1.0), computed in bfloat16: fsdpp with `precision.param_dtype=bfloat16` (float32")
print("reduction; sharded parameters, gradients and AdamW in float32); PyTorch through")
print("`bench/torch_peer.py --dtype bfloat16`: `fully_shard` with MixedPrecisionPolicy(param_dtype=bfloat16,")
print("reduce_dtype=float32), the same policy, and DDP and eager with their forward under")
print("torch.autocast(\"cpu\", bfloat16), PyTorch's way for those (products in bfloat16; norms, softmax and")
print("the loss as autocast decides). Float32 runs of both beside them. Tokens/s over 20 steps after 5")
print(f"warm-up steps, median over {rounds} interleaved rounds.")
print()
print("| run | tokens/s (median) | rounds |")
print("|---|---:|---|")
for name, label in LABELS.items():
    print(f"| {label} | {statistics.median(runs[name]):,.0f} | {' '.join(f'{v:.0f}' for v in runs[name])} |")
print()
print("Side-by-side ratios, median over rounds:")
print()
print(f"- fsdpp dp=2 / PyTorch `fully_shard` dp=2, both bfloat16 and gathering once per step: {ratio('fsdpp-dp2-bf16', 'pytorch-fsdp-dp2-kept-bf16')}")
print(f"- fsdpp dp=2 / PyTorch DDP dp=2, both bfloat16: {ratio('fsdpp-dp2-bf16', 'pytorch-ddp-dp2-bf16')}")
print(f"- fsdpp dp=1 / PyTorch eager, both bfloat16: {ratio('fsdpp-dp1-bf16', 'pytorch-eager-dp1-bf16')}; "
      f"with `cpu.microbatch_threads=2`: {ratio('fsdpp-dp1-threads-bf16', 'pytorch-eager-dp1-bf16')}")
print(f"- bfloat16 / float32, fsdpp dp=1 with microbatch threads: {ratio('fsdpp-dp1-threads-bf16', 'fsdpp-dp1-threads')}; "
      f"PyTorch eager: {ratio('pytorch-eager-dp1-bf16', 'pytorch-eager-dp1')}")
PY
mv "$out.tmp" "$out"
cat "$out"
