#!/usr/bin/env bash
# The model's weight products by ATen (bench/matmul_bench.cpp) with MKL's own choice of kernels
# (FSDPP_MKL_VENDOR_CHECK=1, what a plain LibTorch program gets) and with the kernels chosen by
# instruction set (libfsdpp_mkl_kernels.so, what `fsdpp` asks for; Note [MKL's kernels on other
# vendors' CPUs]), one process each way, alternating, `rounds` times, at 1 and 2 threads; writes
# bench/results/matmul.md. Runs with the machine's OPENBLAS_* settings as they are.
#   bash bench/run_matmul_bench.sh [build-dir] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-6}
out=bench/results/matmul.md
source bench/preamble.sh
for r in $(seq 1 "$rounds"); do
  for t in 1 2; do
    # Each round starts with the other way, so that neither always runs first.
    if [ $((r % 2)) = 1 ]; then order="1 0"; else order="0 1"; fi
    for check in $order; do
      FSDPP_MKL_VENDOR_CHECK=$check "$build/bench/fsdpp_matmul_bench" --threads "$t" --rounds 5 |
        sed -n "s/^RESULT matmul /check=$check round=$r /p" >> "$work/results.txt"
    done
  done
done
"$python" - "$work/results.txt" "$build" "$rounds" "$cpu" "$(nproc)" > "$out.tmp" <<'PY'
import collections, datetime, statistics, sys
path, build, rounds, cpu, cores = sys.argv[1:]
ms = collections.defaultdict(dict)  # (way, threads, check) -> round -> ms
for line in open(path):
    f = dict(kv.split("=") for kv in line.split())
    ms[(f["way"], int(f["threads"]), f["check"])][int(f["round"])] = float(f["fwd_bwd_ms"])
print("# The model's weight products: MKL's own choice of kernels against kernels by instruction set")
print()
print(f"Command: `bash bench/run_matmul_bench.sh {build} {rounds}` ({datetime.date.today()}), {cores} cores of {cpu}, OPENBLAS_* as set by the machine.")
print()
print("Forward and backward (x W^T, then the gradients of x and W) by `at::linear` and `at::_grouped_mm`")
print("(MKL's sgemm) at moe-small's shapes for one microbatch of a dp 2 rank (`bench/matmul_bench.cpp`).")
print("*own*: `FSDPP_MKL_VENDOR_CHECK=1`, MKL's own choice, what a plain LibTorch or PyTorch process runs;")
print("*by ISA*: MKL's kernels chosen by instruction set, as `fsdpp` asks through libfsdpp_mkl_kernels.so")
print("(`include/fsdpp/base/mkl_dispatch.hpp`). One process per way and round, alternating; medians over")
print(f"{rounds} rounds, and the median and range of the per-round ratios. On an Intel CPU, or one without")
print("AVX-512, both ways are MKL's own choice and the ratio is noise.")
print()
print("| product | threads | own ms | by ISA ms | speedup (median) | range |")
print("|---|---:|---:|---:|---:|---|")
for way in ["qkv", "w2", "experts"]:
    for t in [1, 2]:
        own, isa = ms[(way, t, "1")], ms[(way, t, "0")]
        ratios = [own[r] / isa[r] for r in own if r in isa]
        print(f"| {way} | {t} | {statistics.median(own.values()):.3f} | {statistics.median(isa.values()):.3f} | "
              f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")
PY
mv "$out.tmp" "$out"
cat "$out"
