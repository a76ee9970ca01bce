#!/usr/bin/env bash
# Where one dp 1 training step of the default model goes, with its weight products on oneDNN
# (model.onednn_matmul=true, the default) and on ATen's (MKL's sgemm): `fsdpp run
# recipes/moe-small.json parallel.dp=1` under `perf record`, each way, samples grouped by what they
# do, beside the median step time. Needs perf (Debian's linux-perf). Writes
# bench/results/step_profile.md.
#   bash bench/run_step_profile.sh [build-dir] [steps]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
steps=${2:-40}
command -v perf > /dev/null || { echo "needs perf (apt-get install linux-perf)"; exit 1; }
python=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python
out=bench/results/step_profile.md
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
hz=999
for onednn in false true; do
  perf record -q -F $hz -o "$work/$onednn.data" -- "$build/fsdpp" run recipes/moe-small.json parallel.dp=1 \
    model.onednn_matmul=$onednn eval.interval=0 checkpoint.interval=0 logging.plot=false \
    logging.output_dir="$work/run-$onednn" --overwrite --stop-after "$steps" > "$work/$onednn.log" 2>&1
  perf report -i "$work/$onednn.data" --no-children --sort dso,sym -F sample,dso,sym 2> /dev/null \
    | grep -v '^#' | grep -v '^$' > "$work/$onednn.txt"
done
"$python" - "$work" "$build" "$steps" "$hz" > "$out.tmp" <<'PY'
import collections, datetime, json, re, sys
work, build, steps, hz = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
RULES = [  # first match wins
    ("weight products, oneDNN (its JIT-compiled kernels)", lambda dso, s: dso.startswith("[JIT]")),
    ("oneDNN's set-up around each product", lambda dso, s: dso.startswith("libtorch") and re.search(r"dnnl|ideep|mkldnn", s)),
    ("MKL sgemm: the weight products on ATen, and attention's blocks on both", lambda dso, s: re.search(r"mkl_|sgemm|gemm", s)),
    ("attention (flash kernels, forward and backward, less their sgemm)", lambda dso, s: "flash_attention" in s),
    ("OpenMP waits (the second thread idle or at a barrier)", lambda dso, s: dso.startswith("libgomp")),
    ("fsdpp's kernels (RMSNorm, SwiGLU, rotary)", lambda dso, s: dso.startswith("libfsdpp") and re.search(r"rms_|swiglu|rotate|widen|narrow|sum_rows|exp_poly", s)),
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
before, after = shares("false"), shares("true")
print("# Where a dp 1 step goes: the weight products on oneDNN and on ATen's BLAS")
print()
print(f"Command: `bash bench/run_step_profile.sh {build} {steps}` ({datetime.date.today()}), 2 cores, OPENBLAS_* as set by the machine.")
print()
print("`fsdpp run recipes/moe-small.json parallel.dp=1` (32 x 128 tokens per step, 2 microbatches, 2 threads)")
print(f"under `perf record -F {hz}` for {steps} steps (start-up included: about a second of the run), with")
print("`model.onednn_matmul=false` (the weight products by ATen: MKL's sgemm) and `true` (the default: oneDNN,")
print("`include/fsdpp/models/matmul.hpp`); both threads' samples, grouped by symbol (oneDNN's kernels are")
print("compiled at run time and have none: perf's `[JIT]`), as shares of each run; one run each way. The")
print("step times are the runs' medians (`summary.json`).")
print()
print(f"Median step: {step_ms('false'):.0f} ms with ATen's products, {step_ms('true'):.0f} ms with oneDNN's.")
print()
print("| where | ATen's products | oneDNN's |")
print("|---|---:|---:|")
for g in [g for g, _ in RULES] + ["other"]:
    print(f"| {g} | {before.get(g, 0):.1f}% | {after.get(g, 0):.1f}% |")
PY
mv "$out.tmp" "$out"
cat "$out"
