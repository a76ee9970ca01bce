"""How the speed of this machine's first two CPUs moves, each against the other: one process per
CPU, pinned, runs the same single-threaded matrix products for `seconds`, timing each batch;
the batches are then binned by time and, per bin, the first CPU's time over the second's taken.
Prints the spread of that ratio (standard deviation of its logarithm) and its lag-1
autocorrelation for bins of 50 ms, 200 ms and 1 s: a slow CPU that stays slow for a while shows
as a high autocorrelation. Needs PyTorch (the venv's).

    python bench/cpu_speed_pair.py [seconds]
"""
import json
import math
import os
import subprocess
import sys
import tempfile

if len(sys.argv) > 2 and sys.argv[1] == "--worker":
    import time
    import torch
    cpu, seconds, out = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    for _ in range(50):
        torch.mm(a, b)
    batches, end = [], time.time() + seconds
    while time.time() < end:
        t0 = time.time()
        for _ in range(120):
            torch.mm(a, b)
        batches.append((t0, time.time() - t0))
    json.dump(batches, open(out, "w"))
    sys.exit(0)

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20
cpus = sorted(os.sched_getaffinity(0))
if len(cpus) < 2:
    sys.exit("needs two CPUs")
with tempfile.TemporaryDirectory() as d:
    outs = [f"{d}/{c}.json" for c in cpus[:2]]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(c), str(seconds), o]) for c, o in zip(cpus, outs)]
    if any(p.wait() for p in procs):
        sys.exit("a worker failed")
    series = [json.load(open(o)) for o in outs]
start = max(s[0][0] for s in series)


def binned(batches, width):
    bins = {}
    for t, dt in batches:
        if t >= start:
            bins.setdefault(int((t - start) // width), []).append(dt)
    return {k: sum(v) / len(v) for k, v in bins.items()}


for width in (0.05, 0.2, 1.0):
    a, b = binned(series[0], width), binned(series[1], width)
    keys = sorted(set(a) & set(b))
    logs = [math.log(a[k] / b[k]) for k in keys]
    m = sum(logs) / len(logs)
    var = sum((x - m) ** 2 for x in logs) / len(logs)
    cov = sum((x - m) * (y - m) for x, y in zip(logs, logs[1:])) / (len(logs) - 1)
    print(f"bin_ms={width * 1000:.0f} bins={len(keys)} spread={math.sqrt(var):.3f} autocorrelation={cov / var:.2f}")
