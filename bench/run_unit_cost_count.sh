#!/usr/bin/env bash
# What fully_shard adds per unit per step, counted rather than timed: the unit-cost model (200 units
# of Linear(8, 8), one rank, flight recorder on) run under callgrind, unsharded and sharded, for 3
# and for 9 steps; the difference between the two lengths is what 6 steps cost, so start-up and
# sharding drop out. Counts of instructions and of simulated L1 data-cache read misses do not move
# with the machine's load, as the timings of bench/run_unit_cost_profile.sh do by 20-50% on a
# shared machine, so two builds can be compared in one run of this script. Writes
# bench/results/unit_cost_count.md.
#   bash bench/run_unit_cost_count.sh [build-dir] [label=dir ...]
# Each label=dir adds another build beside this one: dir holds its fsdpp_fsdp_bench,
# libfsdpp.so and libfsdpp_gloo.so (copied from that build's tree). Needs valgrind (Debian's
# valgrind package); about 2 minutes per run, 4 runs per build.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
shift || true
command -v valgrind > /dev/null || { echo "needs valgrind (apt-get install valgrind)"; exit 1; }
out=bench/results/unit_cost_count.md
variants=("this build=$build/bench/fsdpp_fsdp_bench:$build")
for v in "$@"; do
  dir=${v#*=}
  [[ $v == *=* && -x $dir/fsdpp_fsdp_bench && -f $dir/libfsdpp.so ]] ||
    { echo "$v: expected label=dir, dir holding fsdpp_fsdp_bench, libfsdpp.so and libfsdpp_gloo.so"; exit 1; }
  variants+=("${v%%=*}=$dir/fsdpp_fsdp_bench:$dir")
done
# One rank without the launcher (callgrind would follow the launcher, not the rank).
export WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
port=$((20000 + RANDOM % 20000))
i=0
for v in "${variants[@]}"; do
  spec=${v#*=}
  bin=${spec%%:*} lib=${spec#*:}
  for side in plain sharded; do
    for steps in 3 9; do
      port=$((port + 1))
      echo "${v%%=*}: $side, $steps steps" >&2
      MASTER_PORT=$port LD_LIBRARY_PATH=$lib valgrind --tool=callgrind --cache-sim=yes \
        --callgrind-out-file="$work/$i-$side-$steps.out" "$bin" unit-cost --steps "$steps" --only "$side" \
        > "$work/$i-$side-$steps.log" 2>&1
      callgrind_annotate --inclusive=yes --show=Ir --threshold=100 "$work/$i-$side-$steps.out" > "$work/$i-$side-$steps.txt" 2> /dev/null
    done
  done
  echo "${v%%=*}" > "$work/$i.label"
  i=$((i + 1))
done
"$python" - "$work" "$i" "$build" "$*" > "$out.tmp" <<'PY'
import datetime, re, sys
work, count, build, others = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
UNITS, STEPS = 200, 6  # 9 - 3

def totals(run):
    text = open(f"{work}/{run}.out").read()
    events = re.search(r"^events: (.*)$", text, re.M).group(1).split()
    summary = [int(x) for x in re.search(r"^summary: (.*)$", text, re.M).group(1).split()]
    return dict(zip(events, summary))

def per_step(i, side, event):
    return (totals(f"{i}-{side}-9")[event] - totals(f"{i}-{side}-3")[event]) / STEPS

# Inclusive instructions of the functions a sharded step runs per unit, by the start of the name.
FUNCS = [
    ("pre-forward (wait for the gather, prefetch the next)", r"fsdpp::fsdp::Unit::pre_forward\(\)"),
    ("post-forward (reshard)", r"fsdpp::fsdp::Unit::post_forward\(\)"),
    ("hooking the output for pre-backward", r"fsdpp::fsdp::Unit::finish_output\("),
    ("post-backward hook or node (set up in forward)", r"fsdpp::fsdp::Unit::mark_for_post_backward\("),
    ("pre-backward hook", r"fsdpp::fsdp::Unit::pre_backward\(\)"),
    ("post-backward (pack, reduce-scatter)", r"fsdpp::fsdp::Unit::post_backward\(\)"),
    ("end of backward (wait, hand out gradients)", r"fsdpp::fsdp::Unit::finish_backward\("),
    ("of which: Comm::all_gather", r"fsdpp::comm::Comm::all_gather\("),
    ("of which: Comm::reduce_scatter", r"fsdpp::comm::Comm::reduce_scatter\("),
    ("of which: ParamGroup::allocate and release", r"fsdpp::fsdp::ParamGroup::(allocate|release)\("),
]

def inclusive(run):
    found = {}  # label -> {function: its inclusive count}
    for line in open(f"{work}/{run}.txt"):
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+[^:]*:(.*) \[", line)
        if not m:
            continue
        n, fn = int(m.group(1).replace(",", "")), m.group(2)
        for label, pat in FUNCS:
            # The first (largest) line for a function is its own; later ones are inlined copies.
            # Matched from the start of the name: a lambda defined inside a hook is not the hook.
            # A label may name several functions (allocate and release): their counts add up.
            if re.match(pat, fn) and fn not in found.setdefault(label, {}):
                found[label][fn] = n
    return {label: sum(fns.values()) for label, fns in found.items()}

labels = [open(f"{work}/{i}.label").read().strip() for i in range(count)]
print("# fully_shard's per-unit cost, counted")
print()
extra = f" {others}" if others else ""
print(f"Command: `bash bench/run_unit_cost_count.sh {build}{extra}` ({datetime.date.today()}), callgrind"
      " (valgrind) with its cache simulation.")
print()
print("The unit-cost model of `bench/fsdp_bench.cpp` (200 FSDP units of Linear(8, 8), one rank, flight")
print("recorder on) run unsharded and sharded for 3 and for 9 steps; a step's count is the difference")
print("over 6, so start-up and sharding drop out. The sharded run's extra per unit per step is what")
print("fully_shard adds. Counts do not move with the machine's load as times do; on a core doing one")
print("to two instructions per cycle, 10 000 instructions are 2 to 4 us at 2.5 GHz. Misses (per unit")
print("per step, like the instructions) are of callgrind's simulated first-level caches; each costs")
print("about ten cycles or more, so a change can save time while adding instructions.")
print()
print("| build | instructions per unit per step | L1 data read misses | L1 instruction misses | the unsharded model's instructions per unit per step |")
print("|---|---:|---:|---:|---:|")
for i, label in enumerate(labels):
    ir, d1, i1 = ((per_step(i, "sharded", e) - per_step(i, "plain", e)) / UNITS for e in ("Ir", "D1mr", "I1mr"))
    plain = per_step(i, "plain", "Ir") / UNITS
    print(f"| {label} | {ir:,.0f} | {d1:,.0f} | {i1:,.0f} | {plain:,.0f} |")
print()
print("Where the sharded step's instructions go, per unit per step (inclusive: a hook with what it calls):")
print()
print("| | " + " | ".join(labels) + " |")
print("|---|" + "---:|" * count)
rows = {}
for i in range(count):
    a, b = inclusive(f"{i}-sharded-3"), inclusive(f"{i}-sharded-9")
    for label, _ in FUNCS:
        # A function gcc inlined into all its callers has no listing of its own.
        v = (b[label] - a.get(label, 0)) / STEPS / UNITS if label in b else None
        rows.setdefault(label, []).append(v)
for label, _ in FUNCS:
    print(f"| {label} | " + " | ".join("inlined" if v is None else f"{v:,.0f}" for v in rows[label]) + " |")
# What the rows above the "of which" ones leave: autograd running the hooks and the identity node,
# FullyShard's forward wrapper, and the unsharded model's own work done differently.
rest = []
for i in range(count):
    total = (per_step(i, "sharded", "Ir") - per_step(i, "plain", "Ir")) / UNITS
    rest.append(total - sum(rows[label][i] or 0 for label, _ in FUNCS if not label.startswith("of which")))
print("| the rest (autograd running the hooks and nodes, the forward wrapper) | "
      + " | ".join(f"{v:,.0f}" for v in rest) + " |")
print()
print("A row counts each function's largest line in callgrind_annotate's listing, which leaves out")
print("code inlined into it from another file when that is listed apart (2c723a0's output hook:")
print("Tensor::register_hook, inlined from Tensor.h). The rest is the total less the rows above the")
print("\"of which\" ones, and can come out below zero: the hooks also do work that the unsharded step")
print("does elsewhere, such as freeing the unsharded gradients (the sharded step frees them after")
print("packing, the unsharded one in zero_grad). \"inlined\": no call reached that function's own copy;")
print("gcc inlined it into its callers, whose rows count it.")
PY
mv "$out.tmp" "$out"
cat "$out"
