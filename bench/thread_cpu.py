"""Runs a command and records, for every thread of its child processes (the ranks that `fsdpp run`
launches), what the kernel says it did: CPU time (user + system, /proc/<pid>/task/<tid>/stat),
time running and time runnable but waiting for a CPU (schedstat), and how long it was seen. The
last reading before each thread ended counts; readings are 0.2 s apart.
    python bench/thread_cpu.py OUT.json COMMAND...
OUT.json: {"<pid>": [{"tid", "cpu_s", "run_s", "runq_s", "seen_s"}, ...], ...}, one entry per rank;
a thread's time blocked (waiting for something other than a CPU) is seen_s - run_s - runq_s."""
import json
import os
import subprocess
import sys
import time

out, command = sys.argv[1], sys.argv[2:]
tick = os.sysconf("SC_CLK_TCK")
proc = subprocess.Popen(command)
seen, first = {}, {}
while proc.poll() is None:
    try:
        ranks = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    except OSError:
        ranks = []
    now = time.monotonic()
    for pid in ranks:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                fields = open(f"{base}/stat").read().rsplit(")", 1)[1].split()
                run_ns, runq_ns, _ = map(int, open(f"{base}/schedstat").read().split())
            except (OSError, ValueError):
                continue
            key = (int(pid), int(tid))
            first.setdefault(key, now)
            seen[key] = {"tid": int(tid), "cpu_s": (int(fields[11]) + int(fields[12])) / tick,  # utime + stime
                         "run_s": run_ns / 1e9, "runq_s": runq_ns / 1e9, "seen_s": now - first[key]}
    time.sleep(0.2)
if proc.returncode != 0:
    sys.exit(f"thread_cpu: {' '.join(command)} exited with {proc.returncode}")
by_pid = {}
for (pid, _), t in sorted(seen.items()):
    by_pid.setdefault(str(pid), []).append(t)
if not by_pid:
    sys.exit("thread_cpu: no child process was seen")
json.dump(by_pid, open(out, "w"), indent=1)
