#!/usr/bin/env bash
# Where one dp 1 training step of the default model goes, four ways: on PyTorch's kernels (MKL's own
# choice, FSDPP_MKL_VENDOR_CHECK=1, and model.fused_attention=false), on MKL's kernels chosen by
# instruction set with ATen's flash attention, as fsdpp runs by default (fsdpp's attention kernel),
# and the same with cpu.microbatch_threads=2 (the two microbatches at once, one thread each):
# `fsdpp run recipes/moe-small.json parallel.dp=1` under `perf record`, each way, samples grouped by
# what they do, beside the median step time. Needs perf (Debian's linux-perf). Writes
# bench/results/step_profile.md. perf starts recording `delay-ms` after each run starts (default 4000),
# so that start-up (the model's construction, MKL's and oneDNN's first calls) is left out.
#   bash bench/run_step_profile.sh [build-dir] [steps] [delay-ms]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
steps=${2:-40}
delay_ms=${3:-4000}
command -v perf > /dev/null || { echo "needs perf (apt-get install linux-perf)"; exit 1; }
out=bench/results/step_profile.md
hz=999
# way: FSDPP_MKL_VENDOR_CHECK, model.fused_attention, cpu.microbatch_threads
ways="vendor-aten:1:false:1 isa-sdpa:0:false:1 isa:0:true:1 threads:0:true:2"
for way in $ways; do
  IFS=: read -r name check attention threads <<< "$way"
  FSDPP_MKL_VENDOR_CHECK=$check perf record -q -D "$delay_ms" -F $hz -o "$work/$name.data" -- "$build/fsdpp" run recipes/moe-small.json \
    parallel.dp=1 model.fused_attention=$attention cpu.microbatch_threads=$threads \
    eval.interval=0 checkpoint.interval=0 logging.plot=false \
    logging.output_dir="$work/run-$name" --overwrite --stop-after "$steps" > "$work/$name.log" 2>&1
  perf report -i "$work/$name.data" --no-children --sort dso,sym -F sample,dso,sym 2> /dev/null \
    | grep -v '^#' | grep -v '^$' > "$work/$name.txt"
done
"$python" - "$work" "$build" "$steps" "$hz" "$delay_ms" > "$out.tmp" <<'PY'
import collections, datetime, json, re, sys
work, build, steps, hz, delay_ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
RULES = [  # first match wins
    ("oneDNN (its JIT-compiled kernels)", lambda dso, s: dso.startswith("[JIT]")),
    ("oneDNN's set-up around each product", lambda dso, s: dso.startswith("libtorch") and re.search(r"dnnl|ideep|mkldnn", s)),
    ("MKL sgemm: the weight products on ATen, and attention's products", lambda dso, s: re.search(r"mkl_|sgemm|gemm", s)),
    ("attention (ATen's flash kernels or fsdpp's, forward and backward, less their sgemm)", lambda dso, s: "flash_attention" in s or (dso.startswith("libfsdpp") and re.search(r"softmax_row|probs_row|dscores_row|CausalAttention|forward_head|backward_head", s))),
    ("OpenMP waits (the second thread idle or at a barrier)", lambda dso, s: dso.startswith("libgomp")),
    ("fsdpp's kernels (RMSNorm, SwiGLU, rotary, the MoE layer's router and rows)", lambda dso, s: dso.startswith("libfsdpp") and re.search(r"rms_|swiglu|rotate|widen|narrow|sum_rows|exp_poly|add_span|SoftmaxTopK|DispatchRows|CombineRows|positions_of|sort_by_expert", s)),
    ("ATen elementwise, reductions and copies", lambda dso, s: dso.startswith("libtorch") and re.search(r"Vectorized|vectorized|kernel|reduce|copy|Reduce|loop|softmax|silu|index|scatter|sort", s)),
    ("allocator and page faults", lambda dso, s: (dso.startswith("libc.so") and re.search(r"malloc|free|unlink_chunk|consolidate|tcache|memset|memmove", s)) or "kernel" in dso),
    ("dispatch, autograd and the rest of LibTorch", lambda dso, s: dso.startswith("libtorch") or dso.startswith("libc10")),
    ("fsdpp (trainer, FSDP, data)", lambda dso, s: dso.startswith("libfsdpp") or dso == "fsdpp"),
]
def samples(name):
    d = collections.Counter()
    for line in open(f"{work}/{name}.txt"):
        m = re.match(r"\s*(\d+)\s+(\[JIT\] tid \d+|\S+)\s+\[.\]\s+(.*)", line)
        if m:
            d[(m.group(2), m.group(3).strip())] += int(m.group(1))
    return d
def shares(way):
    groups = collections.Counter()
    for key, n in samples(way).items():
        groups[next((g for g, rule in RULES if rule(*key)), "other")] += n
    total = sum(groups.values())
    return {g: 100 * n / total for g, n in groups.items()}
def step_ms(way):
    return json.load(open(f"{work}/run-{way}/summary.json"))["step_ms_median"]
ways = ["vendor-aten", "isa-sdpa", "isa", "threads"]
share = {w: shares(w) for w in ways}
print("# Where a dp 1 step goes: on PyTorch's kernels, on MKL's kernels by instruction set, with fsdpp's attention kernel, and with the microbatches on threads of their own")
print()
print(f"Command: `bash bench/run_step_profile.sh {build} {steps} {delay_ms}` ({datetime.date.today()}), 2 cores, OPENBLAS_* as set by the machine.")
print()
print("`fsdpp run recipes/moe-small.json parallel.dp=1` (32 x 128 tokens per step, 2 microbatches, 2 threads)")
print(f"under `perf record -D {delay_ms} -F {hz}` for {steps} steps (recording from {delay_ms / 1000:g} s after the start, so that")
print("start-up is left out; the process's end, about 0.2 s, stays in), four ways:")
print("`FSDPP_MKL_VENDOR_CHECK=1 model.fused_attention=false` (MKL's own choice of kernels for every")
print("product, and ATen's flash attention: PyTorch's kernels),")
print("`model.fused_attention=false` (MKL told to choose by instruction set, as `fsdpp` asks:")
print("`include/fsdpp/base/mkl_dispatch.hpp`; ATen's flash attention), the")
print("default (the same, with fsdpp's attention kernel, `src/models/cpu/attention.cpp`: its products on MKL too),")
print("and the default with `cpu.microbatch_threads=2` (the two microbatches at once, one thread each,")
print("every operator on one thread, and OpenMP's idle spin shortened as `fsdpp run` does for such runs:")
print("`include/fsdpp/base/openmp_wait.hpp`).")
print("Both threads' samples, grouped by symbol")
print("(oneDNN's kernels, where ATen uses them, are compiled at run time and have none: perf's `[JIT]`), as shares of each run;")
print("one run each way. The step times are the runs' medians (`summary.json`).")
print()
print("Median step: " + ", ".join(f"{step_ms(w):.0f} ms {label}" for w, label in
      zip(ways, ["on PyTorch's kernels", "on MKL's kernels by instruction set",
                 "with fsdpp's attention kernel as well", "with the microbatches on threads"])) + ".")
print()
print("| where | PyTorch's kernels | MKL's kernels by instruction set | and fsdpp's attention | and microbatch threads |")
print("|---|---:|---:|---:|---:|")
for g in [g for g, _ in RULES] + ["other"]:
    print(f"| {g} | " + " | ".join(f"{share[w].get(g, 0):.1f}%" for w in ways) + " |")
products = {w: sum(share[w].get(g, 0) for g, _ in RULES[:3]) for w in ways}
print()
print("The products (the first three rows) as a share of each way, and how much faster its step would run")
print("if every other operation took no time: " + ", ".join(
    f"{products[w]:.1f}%, {100 / products[w]:.2f}x" for w in ways) + ", in the columns' order.")
PY
mv "$out.tmp" "$out"
cat "$out"
