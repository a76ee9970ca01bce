#!/usr/bin/env bash
# Where fully_shard's per-unit cost goes: the unit-cost model (200 units of Linear(8, 8), one
# rank) stepped alone unsharded and alone sharded under `perf record`, and the sharded run's extra
# samples grouped by what they do; then, without perf, the ATen operators a sharded step adds per
# unit and fsdpp's cost beside PyTorch's fully_shard on the same model (3 rounds, alternating).
# Needs perf (Debian's linux-perf). Writes bench/results/unit_cost_profile.md.
#   bash bench/run_unit_cost_profile.sh [build-dir] [steps]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
steps=${2:-200}
command -v perf > /dev/null || { echo "needs perf (apt-get install linux-perf)"; exit 1; }
out=bench/results/unit_cost_profile.md
# Three alternating profiles of each side; each side's least sampled one (the least disturbed by the
# rest of the machine) is kept.
for round in 1 2 3; do
  for side in plain sharded; do
    perf record -q -F 5000 -o "$work/$side.data" -- "$build/fsdpp" launch --no-prefix --nproc 1 -- \
      "$build/bench/fsdpp_fsdp_bench" unit-cost --steps "$steps" --only "$side" > "$work/$side$round.log" 2>&1
    perf report -i "$work/$side.data" --no-children --sort dso,sym -F sample,dso,sym 2> /dev/null \
      | grep -v '^#' | grep -v '^$' > "$work/$side$round.txt"
  done
done
"$build/fsdpp" launch --no-prefix --nproc 1 -- "$build/bench/fsdpp_fsdp_bench" unit-cost --steps 5 --only ops \
  > "$work/ops.log" 2>&1
for round in 1 2 3; do
  "$build/fsdpp" launch --no-prefix --nproc 1 -- "$build/bench/fsdpp_fsdp_bench" unit-cost --steps 20 2>&1 |
    sed -n 's/.*us_per_unit_per_step=\([0-9.]*\).*/\1/p' >> "$work/fsdpp.txt"
  "$python" bench/torch_peer.py unit-cost --steps 5 2>/dev/null |
    "$python" -c 'import json, sys; print(json.loads(sys.stdin.read())["us_per_unit_per_step"])' >> "$work/torch.txt"
done
"$python" - "$work" "$build" "$steps" > "$out.tmp" <<'PY'
import collections, datetime, re, statistics, sys
work, build, steps = sys.argv[1:]

def samples(run):
    d = collections.Counter()
    for line in open(f"{work}/{run}.txt"):
        m = re.match(r"\s*(\d+)\s+(\S+)\s+\[.\]\s+(.*)", line)
        if m:
            d[(m.group(2), m.group(3).strip())] += int(m.group(1))
    return d

best = {side: min((f"{side}{r}" for r in (1, 2, 3)), key=lambda run: sum(samples(run).values()))
        for side in ("plain", "sharded")}

def step_us(side):
    return float(re.search(r"step_us=(\d+)", open(f"{work}/{best[side]}.log").read()).group(1))

# First matching rule wins.
RULES = [
    ("allocator (malloc/free)", lambda dso, s: dso.startswith("libc.so") and re.search(r"malloc|free|unlink_chunk|consolidate|tcache", s)),
    ("memcpy and copy_block", lambda dso, s: re.search(r"memmove|memcpy|memset|copy_block", s)),
    ("storage resize (unshard/reshard)", lambda dso, s: "resize_storage" in s or "StorageImpl" in s),
    ("flight recorder, Work and labels", lambda dso, s: re.search(r"FlightRecorder|FlightEntry|WorkState|OpLabel|fmt::|Comm::|Gloo|gloo|strlen", s)),
    ("locks", lambda dso, s: "pthread" in s or "futex" in s),
    ("autograd (marker, hooks, views, engine)", lambda dso, s: "autograd" in s or "PostBackwardMarker" in s or "_fw_grad" in s or "AutogradMeta" in s or "as_view" in s),
    ("fsdpp bookkeeping", lambda dso, s: dso.startswith("libfsdpp")),
    ("ATen dispatch and TensorIterator", lambda dso, s: dso.startswith("libtorch") or dso.startswith("libc10")),
    ("kernel", lambda dso, s: "kernel" in dso),
]

plain, sharded = samples(best["plain"]), samples(best["sharded"])
extra = collections.Counter()
for key in set(plain) | set(sharded):
    d = sharded[key] - plain[key]
    group = next((name for name, rule in RULES if rule(*key)), "other")
    extra[group] += d
total = sum(extra.values())
if total <= 0:
    sys.exit(f"the unsharded run took as many samples as the sharded one ({sum(plain.values())} and "
             f"{sum(sharded.values())}): the machine was busy; run again")
per_unit = (step_us("sharded") - step_us("plain")) / 200
print("# fully_shard's per-unit cost: where it goes")
print()
print(f"Command: `bash bench/run_unit_cost_profile.sh {build} {steps}` ({datetime.date.today()}), 2 cores, OPENBLAS_* as set")
print("by the machine. The unit-cost model of `bench/fsdp_bench.cpp` (200 FSDP units of Linear(8, 8),")
print(f"one rank, flight recorder on) stepped {steps} times unsharded, then {steps} times sharded, each under")
print("`perf record -F 5000`, three times alternating, each side's least sampled run kept; the table is")
print("the sharded run's extra samples grouped by symbol (a group with fewer samples when sharded is")
print("negative).")
print()
print(f"Step: {step_us('plain'):.0f} us unsharded, {step_us('sharded'):.0f} us sharded: {per_unit:.1f} us per unit per step.")
print()
print("| where | share of the extra samples |")
print("|---|---:|")
for name, n in extra.most_common():
    if n != 0:
        print(f"| {name} | {100 * n / total:.0f}% |")
print()
print("Largest single symbols among the extra samples:")
print()
top = sorted(((sharded[k] - plain[k], k) for k in set(plain) | set(sharded)), reverse=True)[:12]
for d, (dso, sym) in top:
    print(f"- {100 * d / total:.1f}% `{sym[:90]}` ({dso})")
print()
print("## ATen operators a sharded step adds, per unit")
print()
print("`fsdpp_fsdp_bench unit-cost --only ops`: operators and autograd nodes run on the training thread")
print("over 5 steps (forward, backward, AdamW), sharded minus unsharded, per unit per step.")
print()
print("```")
print("".join(l for l in open(f"{work}/ops.log") if not l.startswith("[")).rstrip())
print("```")
print()
print("## Beside PyTorch, without perf")
print()
fs = [float(x) for x in open(f"{work}/fsdpp.txt").read().split()]
ts = [float(x) for x in open(f"{work}/torch.txt").read().split()]
print("Microseconds per unit per step beyond the unsharded model, 3 alternating rounds (fsdpp's own")
print("figure is each round's median, over 25 pairs of an unsharded and a sharded run of 20 steps, of")
print("the difference within a pair): fsdpp `fsdpp_fsdp_bench")
print("unit-cost`, PyTorch `bench/torch_peer.py unit-cost` (`fully_shard` on each Linear, world 1).")
print()
print("| implementation | rounds | median |")
print("|---|---|---:|")
print(f"| fsdpp | {' '.join(f'{x:.1f}' for x in fs)} | {statistics.median(fs):.1f} |")
print(f"| PyTorch fully_shard | {' '.join(f'{x:.0f}' for x in ts)} | {statistics.median(ts):.0f} |")
print()
print(f"PyTorch / fsdpp: {statistics.median(ts) / statistics.median(fs):.1f}x")
PY
mv "$out.tmp" "$out"
cat "$out"
