#!/usr/bin/env bash
# Collective bandwidth of fsdpp's Gloo communicator beside PyTorch's own ProcessGroupGloo (the Gloo
# inside LibTorch, driven from the venv's PyTorch), at world sizes 2 and 4 on loopback, in float32
# and bfloat16. The two alternate round by round (fsdpp first in odd rounds, PyTorch first in even
# ones) and each reports its median round, so drift on a busy machine hits both alike.
# Writes bench/results/comm_bandwidth.md.
#   bash bench/run_comm_bench.sh [build-dir] [max-mib] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
max_mib=${2:-64}
rounds=${3:-5}
out=bench/results/comm_bandwidth.md
rows=$work/rows

for n in 2 4; do
  for dtype in float32 bfloat16; do
    for ((r = 0; r < rounds; ++r)); do
      ours=("$build/fsdpp" launch --nproc "$n" --no-prefix -- "$build/bench/fsdpp_comm_bench" --max-mib "$max_mib" --dtype "$dtype")
      theirs=("$build/fsdpp" launch --nproc "$n" --no-prefix -- "$python" bench/torch_gloo_bench.py --max-mib "$max_mib" --dtype "$dtype")
      if ((r % 2 == 0)); then "${ours[@]}" >>"$rows"; "${theirs[@]}" >>"$rows"; else "${theirs[@]}" >>"$rows"; "${ours[@]}" >>"$rows"; fi
      echo "comm bench: world $n $dtype round $((r + 1))/$rounds" >&2
    done
  done
done

"$python" - "$rows" "$build" "$max_mib" "$rounds" >"$out.tmp" <<'PY'
import collections, datetime, json, statistics, sys, torch
rows, build, max_mib, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
times, errors = collections.defaultdict(list), {}
for line in open(rows):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    key = (r["world"], r["dtype"], r["op"], r["bytes"], r["impl"])
    if "error" in r:
        errors[key] = r["error"]
    else:
        times[key].append(r["seconds"])
print("# Collective bandwidth: fsdpp's Gloo communicator vs PyTorch's ProcessGroupGloo")
print()
print(f"Command: `bash bench/run_comm_bench.sh {build} {max_mib} {rounds}` ({datetime.date.today()}, 2 cores, "
      f"PyTorch {torch.__version__}; fsdpp on Debian's libgloo, PyTorch on the Gloo inside LibTorch).")
print(f"Each figure is the median of {rounds} rounds, the two implementations alternating round by round;")
print("a round's time is the slowest rank's mean per call. busbw = algbw x (n-1)/n (x 2 for all_reduce).")
print("Ratio = fsdpp busbw / PyTorch busbw.")
for world in (2, 4):
    for dtype in ("float32", "bfloat16"):
        print(f"\n### world size {world}, {dtype} (loopback, one process per rank)\n")
        print("| op | bytes | fsdpp busbw GB/s | PyTorch busbw GB/s | ratio |")
        print("|---|---:|---:|---:|---:|")
        keys = sorted({k[:4] for k in list(times) + list(errors) if k[0] == world and k[1] == dtype},
                      key=lambda k: (("all_gather", "reduce_scatter", "all_reduce").index(k[2]), k[3]))
        for k in keys:
            bus = (2 if k[2] == "all_reduce" else 1) * (world - 1) / world
            cell = {}
            for impl in ("fsdpp", "torch"):
                t = times.get(k + (impl,))
                cell[impl] = k[3] / statistics.median(t) / 1e9 * bus if t else None
            fmt = lambda v, impl: f"{v:.3f}" if v is not None else ("refused: " + errors[k + (impl,)] if k + (impl,) in errors else "n/a")
            ratio = f"{cell['fsdpp'] / cell['torch']:.2f}" if cell["fsdpp"] and cell["torch"] else "n/a"
            print(f"| {k[2]} | {k[3]} | {fmt(cell['fsdpp'], 'fsdpp')} | {fmt(cell['torch'], 'torch')} | {ratio} |")
PY
mv "$out.tmp" "$out"
cat "$out"
