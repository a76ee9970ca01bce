#!/usr/bin/env bash
# Where two builds' training steps go: `fsdpp run recipes/moe-small.json` with CONFIG's overrides,
# run once with each build's libraries under `perf record` (from `delay-ms` after the start, so that
# start-up is left out), the samples grouped by what they do, beside each run's median step time.
# Needs perf (Debian's linux-perf).
#   bash bench/run_ab_profile.sh NAME before=dir after=dir "CONFIG" [steps] [delay-ms]
# Each dir holds a build's libfsdpp.so and libfsdpp_gloo.so (as for bench/run_build_ab.sh); the
# fsdpp CLI of the build folder FSDPP_BUILD (default build) runs both. Runs with the machine's
# OPENBLAS_* settings as they are; writes bench/results/NAME.md.
set -euo pipefail
cd "$(dirname "$0")/.."
usage='usage: bash bench/run_ab_profile.sh NAME before=dir after=dir "CONFIG" [steps] [delay-ms]'
command -v perf > /dev/null || { echo "needs perf (apt-get install linux-perf)"; exit 1; }
source bench/ab_builds.sh
ab_builds "$usage" 1 "$@"
[[ ${#extra[@]} -ge 1 && ${#extra[@]} -le 3 ]] || { echo "$usage"; exit 1; }
config=${extra[0]}
steps=${extra[1]:-100}
delay_ms=${extra[2]:-4000}
build=${FSDPP_BUILD:-build}
source bench/preamble.sh
out=bench/results/$name.md
read -r -a overrides <<< "$config"
for i in 0 1; do
  LD_LIBRARY_PATH=${dirs[$i]} perf record -q -D "$delay_ms" -F 999 -o "$work/$i.data" -- "$fsdpp" run \
    recipes/moe-small.json "${overrides[@]}" eval.interval=0 checkpoint.interval=0 logging.plot=false \
    logging.output_dir="$work/run-$i" --overwrite --stop-after "$steps" > "$work/$i.log" 2>&1 || { cat "$work/$i.log"; exit 1; }
  perf report -i "$work/$i.data" --no-children --sort dso,sym -F sample,dso,sym 2> /dev/null \
    | grep -v '^#' | grep -v '^$' > "$work/$i.txt"
done
"$python" - "$work" "$name" "${labels[0]}=${dirs[0]}" "${labels[1]}=${dirs[1]}" "$config" "$steps" "$delay_ms" "$cpu" \
  "${labels[0]}" "${labels[1]}" > "$out.tmp" <<'PY'
import collections, datetime, json, re, sys
work, name, before, after, config, steps, delay_ms, cpu, l0, l1 = sys.argv[1:]
RULES = [  # first match wins
    ("products: MKL's kernels (float32, bfloat16)", lambda dso, s: dso.startswith("libtorch") and re.search(r"mkl_blas|sgemm|gemm_bf16", s)),
    ("products: oneDNN's kernels compiled at run time (perf's [JIT])", lambda dso, s: dso.startswith("[JIT]")),
    ("oneDNN's set-up around each call (descriptions, cache, attributes, compilation)", lambda dso, s: dso.startswith("libtorch") and re.search(r"dnnl|ideep|Xbyak|mkldnn", s)),
    ("attention (ATen's flash attention or fsdpp's kernel, less their products)", lambda dso, s: "flash_attention" in s or "_exp_reduce_sum_fusion" in s or (dso.startswith("libfsdpp") and re.search(r"softmax_row|probs_row|dscores_row|CausalAttention|forward_head|backward_head", s))),
    ("conversions between bfloat16 and float32 (ATen's copies)", lambda dso, s: dso.startswith("libtorch") and "reduced_float_copy" in s),
    ("fsdpp's kernels (RMSNorm, SwiGLU, rotary, the MoE layer's router and rows)", lambda dso, s: dso.startswith("libfsdpp") and re.search(r"rms_|swiglu|rotate|widen|narrow|sum_rows|exp_poly|add_span|SoftmaxTopK|DispatchRows|CombineRows|positions_of|sort_by_expert", s)),
    ("ATen elementwise, reductions and copies", lambda dso, s: dso.startswith("libtorch") and re.search(r"Vectorized|vectorized|kernel|reduce|copy|Reduce|loop|softmax|silu|index|scatter|sort|Sleef", s)),
    ("allocator and the kernel (page faults, memory maps)", lambda dso, s: (dso.startswith("libc.so") and re.search(r"malloc|free|memalign|unlink_chunk|consolidate|tcache", s)) or "kernel" in dso),
    ("OpenMP waits", lambda dso, s: dso.startswith("libgomp")),
    ("dispatch, autograd and the rest of LibTorch", lambda dso, s: dso.startswith("libtorch") or dso.startswith("libc10")),
]
def shares(i):
    groups = collections.Counter()
    for line in open(f"{work}/{i}.txt"):
        m = re.match(r"\s*(\d+)\s+(\[JIT\] tid \d+|\S+)\s+\[.\]\s+(.*)", line)
        if m:
            dso, sym = m.group(2), m.group(3).strip()
            groups[next((g for g, rule in RULES if rule(dso, sym)), "other")] += int(m.group(1))
    total = sum(groups.values())
    return {g: 100 * n / total for g, n in groups.items()}
def step_ms(i):
    return json.load(open(f"{work}/run-{i}/summary.json"))["step_ms_median"]
share = [shares(0), shares(1)]
ms = [step_ms(0), step_ms(1)]
print(f"# Where a step goes, two builds: `{config}`")
print()
print(f"Command: `bash bench/run_ab_profile.sh {name} {before} {after} \"{config}\" {steps} {delay_ms}` "
      f"({datetime.date.today()}), 2 cores of {cpu}, OPENBLAS_* as set by the machine.")
print()
print(f"`fsdpp run recipes/moe-small.json {config}` for {steps} steps with each build's libraries, under")
print(f"`perf record -D {delay_ms} -F 999` (start-up left out; the process's end stays in), one run each.")
print("Every thread's samples, grouped by symbol; each group as a share of the run's samples.")
print()
print(f"Median step: {ms[0]:.1f} ms {l0}, {ms[1]:.1f} ms {l1} ({ms[0] / ms[1]:.2f}x).")
print()
print(f"| where | {l0} | {l1} |")
print("|---|---:|---:|")
for g in [g for g, _ in RULES] + ["other"]:
    print(f"| {g} | {share[0].get(g, 0):.1f}% | {share[1].get(g, 0):.1f}% |")
PY
mv "$out.tmp" "$out"
cat "$out"
