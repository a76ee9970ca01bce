#!/usr/bin/env bash
# fsdpp beside PyTorch 2.15 on the same work and the same kernels: moe-small's model
# (configs/moe-small.json), global batch 32 x 128 tokens, AdamW (lr 3e-3, betas 0.9/0.95, weight
# decay 0.1 on matrices), gradient clipping at 1.0, the fortunes corpus. Every PyTorch run preloads
# libfsdpp_mkl_kernels.so, so that MKL gives it the kernels it gives `fsdpp run` (Note [MKL's kernels
# on other vendors' CPUs]); two detail rows run both sides on MKL's own choice. Rounds alternate the
# implementations so that a busy machine slows all alike; each ratio is taken within a round, the
# median over rounds, with the rounds' spread. Writes bench/results/pytorch.md.
#   bash bench/run_pytorch_bench.sh [build-dir] [rounds] [output]
# fsdpp runs through `fsdpp run` (the product path: data loading, metrics and progress included);
# PyTorch through bench/torch_peer.py, which says what PyTorch is given. Runs with the machine's
# OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
rounds=${2:-6}
out=${3:-bench/results/pytorch.md}
vendor=$(cpuinfo vendor_id)
source bench/peer_runs.sh
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  fsdpp_run fsdpp-dp2 recipes/moe-small.json
  torch_run pytorch-fsdp-dp2-kept "$fsdpp" launch --nproc 2 -- $same $peer train --mode fsdp --reshard-after-forward false \
    --accum 2 --warmup $warmup --steps $steps
  fsdpp_run fsdpp-dp2-reshard recipes/moe-small.json parallel.reshard_after_forward=true
  torch_run pytorch-fsdp-dp2 "$fsdpp" launch --nproc 2 -- $same $peer train --mode fsdp --accum 2 --warmup $warmup \
    --steps $steps
  torch_run pytorch-ddp-dp2 "$fsdpp" launch --nproc 2 -- $same $peer train --mode ddp --accum 2 --warmup $warmup \
    --steps $steps
  fsdpp_run fsdpp-dp1 recipes/moe-small.json parallel.dp=1
  fsdpp_run fsdpp-dp1-threads recipes/moe-small.json parallel.dp=1 cpu.microbatch_threads=2
  torch_run pytorch-eager-dp1 $same $peer train --mode eager --threads 2 --accum 2 --warmup $warmup --steps $steps
  torch_run pytorch-compile-dp1 $same $peer train --mode compile --threads 2 --accum 2 --warmup 10 --steps $steps
  fsdpp_run fsdpp-pp2 recipes/moe-small-pp.json
  torch_run pytorch-pp2 "$fsdpp" launch --nproc 2 -- $same $peer pp --microbatches 4 --warmup $warmup --steps $steps
  # Detail: both sides on MKL's own choice of kernels (AVX2 on other vendors' CPUs).
  FSDPP_MKL_VENDOR_CHECK=1 fsdpp_run fsdpp-dp1-own recipes/moe-small.json parallel.dp=1
  torch_run pytorch-eager-dp1-own $peer train --mode eager --threads 2 --accum 2 --warmup $warmup --steps $steps
  "$fsdpp" launch --nproc 1 --no-prefix -- "$build/bench/fsdpp_fsdp_bench" unit-cost --steps 20 2>&1 |
    sed -n 's/.*us_per_unit_per_step=\([0-9.]*\).*/fsdpp-unit-cost \1/p' >> "$results"
  $same $peer unit-cost --steps 5 2>/dev/null | "$python" -c '
import json, sys
print("pytorch-unit-cost", json.loads(sys.stdin.read())["us_per_unit_per_step"])' >> "$results"
done
# Where eager PyTorch's step goes, once, after the rounds.
$same $peer profile --mode eager --threads 2 --accum 2 --warmup 3 --steps 5 2>/dev/null | grep '^{' > "$work/profile.json"

"$python" - "$results" "$build" "$rounds" "$work/profile.json" "${3:-}" "$cpu" "$vendor" > "$out.tmp" <<'PY'
import datetime, json, statistics, sys
from collections import defaultdict
import torch
runs = defaultdict(list)
for line in open(sys.argv[1]):
    name, value = line.split()
    runs[name].append(float(value))
med = {k: statistics.median(v) for k, v in runs.items()}
build, rounds = sys.argv[2], sys.argv[3]
cpu, vendor = sys.argv[6], sys.argv[7]
intel = vendor == "GenuineIntel"
# MKL's own choice of kernels: by instruction set on Intel CPUs, its AVX2 ones on others.
own_choice = "AVX-512 here too, as on any Intel CPU" if intel else "AVX2 here"
def row(label, name, unit="tokens/s"):
    print(f"| {label} | {med[name]:.0f} | {' '.join(f'{x:.0f}' for x in runs[name])} |")
print("# fsdpp beside PyTorch 2.15")
print()
extra = f" {sys.argv[5]}" if sys.argv[5] else ""
print(f"Command: `bash bench/run_pytorch_bench.sh {build} {rounds}{extra}` ({datetime.date.today()}), 2 cores "
      f"of {cpu} ({vendor}), "
      f"PyTorch {torch.__version__}, OPENBLAS_* as set by the machine.")
print()
print("Same work on both sides: moe-small's model (4 layers, dim 128, 4 experts top-2, dropless, 1.36M")
print("parameters), global batch 32 x 128 tokens, AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1 on")
print("matrices), clipping at 1.0, windows of the fortunes corpus. fsdpp: `fsdpp run` on the bundled")
print("recipes (metrics and progress included). PyTorch: `bench/torch_peer.py` on fsdpp's model written")
print("in PyTorch (`tests/fsdp/torch_moe.py`, the same operations; fsdpp computes RMSNorm, SwiGLU's gate,")
print("rotary and causal attention by its own kernels, the same functions rounded differently,")
print("`include/fsdpp/models/cpu/kernels.hpp`), torch.optim.AdamW(fused=True) (ATen's fused CPU kernel,")
print("which fsdp::AdamW runs too), torch.nn.utils.clip_grad_norm_. The same kernels: every PyTorch run")
print("preloads `libfsdpp_mkl_kernels.so`, so MKL gives both sides the kernels it gives `fsdpp run` (by")
print(f"instruction set; MKL's own choice is {own_choice}). Threads: 1 per rank at world 2 (the launcher's")
print("OMP_NUM_THREADS=1), 2 in one process. Throughput: tokens of the global batch per second over 20 steps")
print("after 5 warm-up steps (10 for torch.compile), the host synchronised each step by reading the loss,")
print(f"as fsdpp's trainer does; median over {rounds} interleaved rounds. Ratios are side by side: each")
print("round's figure over the other side's in the same round, the median over rounds and the rounds' range.")
print()
print("| run | tokens/s (median) | rounds |")
print("|---|---:|---|")
row("fsdpp dp=2 (`recipes/moe-small.json`: fully_shard, 2 microbatches of 8 per rank, each block gathered once per step)", "fsdpp-dp2")
row("PyTorch `fully_shard(reshard_after_forward=False)` dp=2 (each block, then the root; `set_requires_gradient_sync`, `set_reshard_after_backward` on the last microbatch)", "pytorch-fsdp-dp2-kept")
row("fsdpp dp=2, `parallel.reshard_after_forward=true` (gathered again for backward and each microbatch)", "fsdpp-dp2-reshard")
row("PyTorch `fully_shard` dp=2 (its default: reshard after forward)", "pytorch-fsdp-dp2")
row("PyTorch DDP dp=2 (`no_sync` for the first microbatch)", "pytorch-ddp-dp2")
row("fsdpp dp=1 (`parallel.dp=1`: 2 microbatches of 16, 2 threads)", "fsdpp-dp1")
row("fsdpp dp=1, `cpu.microbatch_threads=2`: the 2 microbatches at once, one thread each", "fsdpp-dp1-threads")
row("PyTorch eager, one process, 2 threads", "pytorch-eager-dp1")
row("PyTorch `torch.compile(model, dynamic=True)`, one process, 2 threads", "pytorch-compile-dp1")
row("fsdpp pp=2 (`recipes/moe-small-pp.json`: 1F1B, 4 microbatches of 8)", "fsdpp-pp2")
row("PyTorch pp=2 (`PipelineStage` + `Schedule1F1B`, the same split: embed + layers 0-1, then layers 2-3 + norm + head)", "pytorch-pp2")
row(f"detail: fsdpp dp=1 on MKL's own choice of kernels (`FSDPP_MKL_VENDOR_CHECK=1`: {own_choice})", "fsdpp-dp1-own")
row("detail: PyTorch eager on MKL's own choice of kernels (nothing preloaded)", "pytorch-eager-dp1-own")
print()
def ratios(a, b):
    return [x / y for x, y in zip(runs[a], runs[b])]
def ratio(a, b):
    return statistics.median(ratios(a, b))
def spread(a, b):
    r = ratios(a, b)
    return f"**{statistics.median(r):.2f}x** ({min(r):.2f} to {max(r):.2f})"
print("Side-by-side ratios on the same kernels, median over rounds (the rounds' range in brackets):")
print()
print(f"- fsdpp dp=2 / PyTorch fully_shard dp=2, both gathering once per step: {spread('fsdpp-dp2', 'pytorch-fsdp-dp2-kept')}")
print(f"- fsdpp dp=2 / PyTorch fully_shard dp=2, both resharding after forward: {spread('fsdpp-dp2-reshard', 'pytorch-fsdp-dp2')}")
print(f"- fsdpp dp=2 / PyTorch DDP dp=2: {spread('fsdpp-dp2', 'pytorch-ddp-dp2')}")
print(f"- fsdpp dp=1 / PyTorch eager: {spread('fsdpp-dp1', 'pytorch-eager-dp1')}; with `cpu.microbatch_threads=2`: {spread('fsdpp-dp1-threads', 'pytorch-eager-dp1')}")
print(f"- fsdpp dp=1 / torch.compile: {spread('fsdpp-dp1', 'pytorch-compile-dp1')}; with `cpu.microbatch_threads=2`: {spread('fsdpp-dp1-threads', 'pytorch-compile-dp1')}")
print(f"- fsdpp pp=2 / PyTorch Schedule1F1B: {spread('fsdpp-pp2', 'pytorch-pp2')}")
print(f"- detail, both on MKL's own choice: fsdpp dp=1 / PyTorch eager {spread('fsdpp-dp1-own', 'pytorch-eager-dp1-own')}")
print()
prof = json.load(open(sys.argv[4]))
print("Where PyTorch eager's step goes (`torch_peer.py profile`: torch.profiler over 5 steps of the eager")
print(f"run above, 2 threads; self time per operation): a step of {prof['step_ms']:.0f} ms under the profiler, "
      f"**{100 * prof['matmul_share']:.0f}%** in")
print(f"matrix multiplies (mm, bmm, addmm) and {100 * prof['attention_share']:.0f}% in the fused attention kernel. Any implementation")
print("running the same matrix-multiply kernels is at most 1 / that share faster than eager however well it")
largest = ", ".join(f"{k.replace('aten::', '')} {100 * v:.0f}%" for k, v in prof["top"][:8])
print(f"fuses the rest: **{prof['ceiling']:.2f}x** (eager ran on the kernels fsdpp runs). Largest: {largest}.")
print()
print("## Per-unit framework cost (200 units of Linear(8, 8), each its own unit, one rank)")
print()
print("Microseconds per unit per step beyond the same model unsharded: fsdpp `bench/fsdp_bench.cpp")
print("unit-cost` (the median, over 25 pairs of an unsharded and a sharded run of 20 steps, in alternating")
print("order, of the difference within a pair), PyTorch `torch_peer.py unit-cost` (`fully_shard` on each")
print("Linear, world 1 over Gloo; medians of 7 alternating rounds of each).")
print()
print("| implementation | us per unit per step (median) | rounds |")
print("|---|---:|---|")
for label, name in (("fsdpp", "fsdpp-unit-cost"), ("PyTorch fully_shard", "pytorch-unit-cost")):
    print(f"| {label} | {med[name]:.1f} | {' '.join(f'{x:.1f}' for x in runs[name])} |")
print()
print(f"PyTorch / fsdpp: **{ratio('pytorch-unit-cost', 'fsdpp-unit-cost'):.1f}x**")
PY
mv "$out.tmp" "$out"
cat "$out"
