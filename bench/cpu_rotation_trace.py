"""Reads one dp = 2 trace of a run made with FSDPP_CPU_ROTATION_ALTERNATE_MS (see
bench/run_cpu_rotation_bench.sh) and prints, for the steps that ran wholly while the computing
threads rotated and for those that ran wholly while each rank stayed on its own CPU: how many,
their mean step time, and the mean gap between the two ranks' issue of the step's last
reduce-scatter (the root's), which is how far apart the ranks drifted within the step.

    python bench/cpu_rotation_trace.py trace.json alternate_ms [skip_steps]

The trace's times are the system clock's and the rotation's windows follow the monotonic clock;
each rank's process_name entry in the trace carries the first less the second
(`monotonic_offset_us`, read when tracing started).
"""
import json
import statistics
import sys

path, alternate_ms = sys.argv[1], float(sys.argv[2])
skip = int(sys.argv[3]) if len(sys.argv) > 3 else 3
trace = json.load(open(path))
events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("ph") == "X"]
tracks = {}  # (pid, track name) -> tid
offsets = {}  # pid -> system clock less monotonic clock, us
for e in (trace["traceEvents"] if isinstance(trace, dict) else trace):
    if e.get("ph") == "M" and e.get("name") == "thread_name":
        tracks[(e["pid"], e["args"]["name"])] = e["tid"]
    if e.get("ph") == "M" and e.get("name") == "process_name" and "monotonic_offset_us" in e["args"]:
        offsets[e["pid"]] = e["args"]["monotonic_offset_us"]
if not offsets:
    sys.exit(f"{path}: no monotonic_offset_us in the trace's process_name entries (written by an older fsdpp)")
# Both ranks read the same two clocks; their readings differ by the microseconds between the reads.
offset = statistics.median(offsets.values()) / 1e6

steps = {}  # step -> {rank: (begin us, end us)}
root_rs = {0: [], 1: []}  # rank -> issue times of the root unit's reduce-scatter
for e in events:
    if e["tid"] == tracks.get((e["pid"], "steps")) and e["name"].startswith("step "):
        steps.setdefault(int(e["name"].split()[1]), {})[e["pid"]] = (e["ts"], e["ts"] + e["dur"])
    elif e["name"].startswith("reduce_scatter") and e["name"].endswith(" root") and e["pid"] in root_rs:
        root_rs[e["pid"]].append(e["ts"])


def window(ts_us):  # 0: rotating, 1: each rank on its own CPU
    return int((ts_us / 1e6 - offset) * 1000 // alternate_ms) % 2


times = {0: [], 1: []}
gaps = {0: [], 1: []}
for step, ranks in sorted(steps.items()):
    if step <= skip or set(ranks) != {0, 1}:
        continue
    begin = min(b for b, _ in ranks.values())
    end = max(e for _, e in ranks.values())
    w = window(begin)
    if window(end) != w:
        continue
    times[w].append((ranks[0][1] - ranks[0][0]) / 1e3)
    issued = [[t for t in root_rs[r] if ranks[r][0] <= t <= ranks[r][1]] for r in (0, 1)]
    if issued[0] and issued[1]:  # the flight recorder keeps the latest collectives only
        gaps[w].append(abs(issued[0][0] - issued[1][0]) / 1e3)

if len(times[0]) < 5 or len(times[1]) < 5:
    sys.exit(f"{path}: too few steps wholly inside one kind of window ({len(times[0])} rotating, "
             f"{len(times[1])} fixed); run more steps or use longer windows")
mean = statistics.mean
print(f"rotating_steps={len(times[0])} rotating_ms={mean(times[0]):.2f} "
      f"rotating_gap_ms={mean(gaps[0]) if gaps[0] else float('nan'):.2f} "
      f"fixed_steps={len(times[1])} fixed_ms={mean(times[1]):.2f} "
      f"fixed_gap_ms={mean(gaps[1]) if gaps[1] else float('nan'):.2f} "
      f"speedup={mean(times[1]) / mean(times[0]):.4f}")
