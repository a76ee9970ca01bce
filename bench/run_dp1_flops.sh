#!/usr/bin/env bash
# The FLOP/s that dp 1 training rates imply for moe-small's model, against one core's float32
# matrix-multiply speed on this machine (bench/model_flops.py; libfsdpp_mkl_kernels.so preloaded so that MKL
# runs the kernels fsdpp's products run, on any vendor's CPU). The rates are given as NAME=TOKENS_PER_S,
# for example the medians of bench/results/pytorch.md. Writes bench/results/dp1_flops.md, or the
# file given by FSDPP_FLOPS_OUT. Runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_dp1_flops.sh [build-dir] NAME=TOKENS_PER_S ...
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
shift || true
out=${FSDPP_FLOPS_OUT:-bench/results/dp1_flops.md}
log=$work/log
LD_PRELOAD=$(realpath "$build/libfsdpp_mkl_kernels.so") "$python" bench/model_flops.py configs/moe-small.json 128 "$@" | tee "$log"
"$python" - "$log" "$build" "$cpu" "$(nproc)" "$*" > "$out.tmp" <<'PY'
import datetime, re, sys
log, build, cpu, cores, args = sys.argv[1:6]
lines = open(log).read().splitlines()
result = next(l for l in lines if l.startswith("RESULT"))
core = float(re.search(r"core_gflops=([\d.]+)", result).group(1))
bound = float(re.search(r"products_bound_per_core=([\d.]+)", result).group(1))
cores = int(cores)
print("# dp 1 training rates as FLOP/s, against the cores' matrix-multiply speed")
print()
print(f"Command: `bash bench/run_dp1_flops.sh {build} {args}` ({datetime.date.today()}), {cores} cores of {cpu}, "
      "OPENBLAS_* as set by the machine.")
print()
print("`bench/model_flops.py` counts the matrix-multiply work of a training token of moe-small's model at")
print("sequence length 128 (forward multiply-adds, times 2 FLOP, times 3 for forward and backward; norms,")
print("element-wise work and lookups count nothing) and times one-thread `torch.mm` on MKL's AVX-512")
print("kernels, the best of 30 calls, with the other core idle; then the model's own weight products for one")
print("microbatch of 16 sequences, each layer's forward and both gradients at its own shape (the experts'")
print("on their share of the routed rows), medians of 15 calls, warm and with the caches cleared before each.")
print("The warm ones with attention's products at the best speed bound the tokens/s of one thread per core")
print("on these kernels, every other operation free:")
print()
for l in lines:
    if not l.startswith(("RESULT", "RUN")):
        print(f"- {l}")
print()
print(f"| run | tokens/s | GFLOP/s | of {cores} x {core:.0f} GFLOP/s | of {cores} x {bound:,.0f} tokens/s (the products alone) |")
print("|---|---:|---:|---:|---:|")
for l in lines:
    m = re.match(r"RUN (\S+) tokens_per_s=(\d+) gflops=([\d.]+)", l)
    if m:
        g = float(m.group(3))
        print(f"| {m.group(1)} | {m.group(2)} | {g:.1f} | {100 * g / (cores * core):.0f}% | "
              f"{100 * float(m.group(2)) / (cores * bound):.0f}% |")
PY
mv "$out.tmp" "$out"
cat "$out"
