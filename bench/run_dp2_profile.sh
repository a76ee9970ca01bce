#!/usr/bin/env bash
# Where a dp 2 step's time goes beside the communication-free limit: `fsdpp run recipes/moe-small.json`
# (dp 2 as the recipe places it) and two independent one-rank runs of half the batch each
# (parallel.dp=1 train.global_batch=16, one thread each, started together: the same compute, no
# collectives), alternating, `rounds` times. Each run is traced (`--trace`: every phase of a step
# on the computing thread) and recorded by `perf record -e cpu-clock` on the same clock, so the CPU
# time of the traced steps alone is split into computing, fsdpp's collectives and the kernel; what
# is left of 2 CPUs over those steps is time no thread of the run was running. Needs perf (Debian's
# linux-perf). Writes bench/results/dp2_profile.md, or the file given third; recipe overrides after it
# apply to the dp 2 runs (parallel.reshard_after_forward=true, say).
#   bash bench/run_dp2_profile.sh [build-dir] [rounds] [output] [override...]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-3}
out=${3:-bench/results/dp2_profile.md}
overrides=("${@:4}")
command -v perf > /dev/null || { echo "needs perf (apt-get install linux-perf)"; exit 1; }
source bench/preamble.sh
hz=999
traced=40  # steps traced, from each run's second step

# One run of `way` under perf (sample times on the realtime clock, as the trace's): dp2 writes
# $d-0, free its two runs $d-0 and $d-1.
run_way() {
  local way=$1 d=$2
  local args=(eval.interval=0 checkpoint.interval=0 logging.interval=1 logging.plot=false --overwrite
              --stop-after $((traced + 1)) --trace --trace-steps $traced)
  local rec=(perf record -q -k realtime -e cpu-clock -F $hz -o "$d.data" --)
  if [ "$way" = dp2 ]; then
    "${rec[@]}" "$fsdpp" run recipes/moe-small.json "${args[@]}" "${overrides[@]}" logging.output_dir="$d-0" \
      > "$d.log" 2>&1 ||
      { cat "$d.log"; exit 1; }
  else
    "${rec[@]}" bash -c '
      for r in 0 1; do
        OMP_NUM_THREADS=1 "$1" run recipes/moe-small.json parallel.dp=1 train.global_batch=16 "${@:3}" \
          logging.output_dir="$2-$r" > "$2-$r.log" 2>&1 &
      done
      for p in $(jobs -p); do wait "$p" || exit 1; done' _ "$fsdpp" "$d" "${args[@]}" > "$d.log" 2>&1 ||
      { cat "$d.log" "$d"-*.log; exit 1; }
  fi
}

# The traced steps' window (seconds on the realtime clock): from the first traced step's start to
# the last one's end; for the two free runs, the part both were in their traced steps.
window() {
  "$python" - "$@" <<'PY'
import json, sys
starts, ends = [], []
for path in sys.argv[1:]:
    t = json.load(open(path))
    steps = [e for e in (t["traceEvents"] if isinstance(t, dict) else t)
             if e.get("ph") == "X" and e.get("pid") == 0 and e.get("tid") == 1]
    starts.append(min(e["ts"] for e in steps) / 1e6)
    ends.append(max(e["ts"] + e["dur"] for e in steps) / 1e6)
print(f"{max(starts):.6f} {min(ends):.6f}")
PY
}

for r in $(seq "$rounds"); do
  echo "round $r of $rounds" >&2
  for way in dp2 free; do
    d=$work/$way-$r
    run_way $way "$d"
    if [ $way = dp2 ]; then w=$(window "$d-0/trace.json"); else w=$(window "$d-0/trace.json" "$d-1/trace.json"); fi
    echo "$w" > "$d.window"
    # tokens/s over the traced steps 2 .. traced + 1, the two free runs' added
    if [ $way = dp2 ]; then
      "$python" bench/metrics_tokens_per_s.py "$d-0/metrics/rank0.jsonl" 1 $((traced + 1)) 4096 | cut -d' ' -f1 > "$d.rate"
    else
      for i in 0 1; do
        "$python" bench/metrics_tokens_per_s.py "$d-$i/metrics/rank0.jsonl" 1 $((traced + 1)) 2048 | cut -d' ' -f1
      done | awk '{ s += $1 } END { print s }' > "$d.rate"
    fi
    perf report -i "$d.data" --time "${w/ /,}" --no-children --sort dso,sym -F period,dso,sym 2> /dev/null |
      grep -v '^#' | grep -v '^$' > "$d.txt"
    rm "$d.data"
  done
done

"$python" - "$work" "$rounds" "$traced" "$hz" "$build" "$cpu" "$(date +%F)" "${3:-}" "${overrides[*]}" > "$out.tmp" <<'PY'
import collections, functools, json, re, statistics, sys
work, rounds, traced, hz, build, cpu, date, output, overrides = sys.argv[1:]
rounds, traced, hz = int(rounds), int(traced), int(hz)
GROUPS = [  # first match wins
    ("computing: LibTorch, fsdpp's model, FSDP and trainer, libc", lambda dso, s: not dso.startswith("[kernel") and not dso.startswith("libfsdpp_gloo")),
    ("fsdpp's collectives on Gloo (libfsdpp_gloo.so)", lambda dso, s: dso.startswith("libfsdpp_gloo")),
    ("the kernel: sockets, polling and system calls", lambda dso, s: re.search(
        r"tcp|sock|skb|_iter|syscall|epoll|ep_|poll|futex|sys_|fput|fdget|loopback|net_|netif|ip_|softirq|__x64|do_sys", s)),
    ("the kernel: scheduling, page faults and the rest", lambda dso, s: True),
]
def cpu_time(path):  # seconds of CPU time by group (cpu-clock periods are nanoseconds)
    d = collections.Counter()
    for line in open(path):
        m = re.match(r"\s*(\d+)\s+(\S+)\s+\[.\]\s+(.*)", line)
        if m:
            d[next(g for g, rule in GROUPS if rule(m.group(2), m.group(3)))] += int(m.group(1)) / 1e9
    return d

# Each phase of a step on the computing thread (compute track: forward and backward of each
# microbatch, clipping with its all-reduce, the optimizer; steps track: the whole step).
PHASES = ["forward, 1st microbatch (all-gathers)", "backward, 1st microbatch", "forward, 2nd microbatch",
          "backward, 2nd microbatch (reduce-scatters)", "clipping (the all-reduce)", "optimizer", "step"]
@functools.cache
def spans(path):  # a trace's complete events, read once: a dp 2 trace serves both ranks' phases and the collectives
    t = json.load(open(path))
    return [e for e in (t["traceEvents"] if isinstance(t, dict) else t) if e.get("ph") == "X"]

def phases(path, pid):
    ev = sorted((e for e in spans(path) if e.get("pid") == pid and e.get("tid") in (0, 1)), key=lambda e: e["ts"])
    out, n = collections.defaultdict(list), {"forward": 0, "backward": 0}
    for e in ev:
        ms = e["dur"] / 1e3
        if e["tid"] == 1:
            out["step"].append(ms)
        elif e["name"] in n:
            out[PHASES[(0 if e["name"] == "forward" else 1) + 2 * (n[e["name"]] % 2)]].append(ms)
            n[e["name"]] += 1
        elif e["name"] == "clip":
            out[PHASES[4]].append(ms)
        elif e["name"] == "optimizer":
            out[PHASES[5]].append(ms)
    return out

WAYS = {"dp2": "dp = 2", "free": "communication-free"}
TRACES = {"dp2": [("dp2-{}-0", 0), ("dp2-{}-0", 1)], "free": [("free-{}-0", 0), ("free-{}-1", 0)]}
figs = {w: collections.defaultdict(list) for w in WAYS}
ph = {w: collections.defaultdict(list) for w in WAYS}
for r in range(1, rounds + 1):
    for w in WAYS:
        d = f"{work}/{w}-{r}"
        start, end = map(float, open(f"{d}.window").read().split())
        wall = end - start
        s = cpu_time(f"{d}.txt")
        figs[w]["tokens/s"].append(float(open(f"{d}.rate").read()))
        for g, _ in GROUPS:
            figs[w][g].append(s[g] / (2 * wall))
        figs[w]["idle"].append(1 - sum(s.values()) / (2 * wall))
        for run, pid in TRACES[w]:
            for k, v in phases(f"{work}/{run.format(r)}/trace.json", pid).items():
                ph[w][k] += v
med = {w: {k: statistics.median(v) for k, v in f.items()} for w, f in figs.items()}
ratio = statistics.median(a / b for a, b in zip(figs["dp2"]["tokens/s"], figs["free"]["tokens/s"]))

print("# dp = 2 beside the communication-free limit: where a step's time goes")
print()
args = " ".join(a for a in (build, str(rounds), output, overrides) if a)
print(f"Command: `bash bench/run_dp2_profile.sh {args}` ({date}), 2 cores of {cpu}, OPENBLAS_* as set by the machine.")
print()
placed = f"with `{overrides}`" if overrides else "as the recipe places it"
print(f"`fsdpp run recipes/moe-small.json` at dp = 2 {placed} (each block gathered once per")
print("step, 2 microbatches of 8 sequences per rank), and the communication-free limit: two independent")
print("one-rank runs of half the batch each (`parallel.dp=1 train.global_batch=16`, one thread each, started")
print(f"together: the same compute with no collectives). The ways alternate, {rounds} rounds. Each run is traced")
print(f"(`--trace --trace-steps {traced}`) and recorded by `perf record -k realtime -e cpu-clock -F {hz}`, whose sample")
print("times are on the trace's clock, so only the traced steps are counted (for the two free runs, the")
print("time both were in them). A thread's samples (their periods) are its CPU time; each group is that")
print("time as a share of both CPUs over the traced steps, and *no thread running* is what is left: CPU")
print("time no thread of the run used (a rank waiting for the other, or the machine's other work).")
print(f"Tokens/s over the traced steps (the runs' metrics); medians over rounds.")
print()
print("| | " + " | ".join(WAYS.values()) + " |")
print("|---|" + "---:|" * len(WAYS))
print("| tokens/s | " + " | ".join(f"{med[w]['tokens/s']:.0f}" for w in WAYS) + " |")
for g, _ in GROUPS + [("idle", None)]:
    label = "no thread running" if g == "idle" else g
    print(f"| {label} | " + " | ".join(f"{100 * med[w][g]:.1f}%" for w in WAYS) + " |")
print()
print(f"dp = 2 over the communication-free limit, tokens/s, median of the rounds' ratios: **{ratio:.3f}x**.")
print("Rounds (tokens/s): " + "; ".join(f"{WAYS[w]} " + ", ".join(f"{x:.0f}" for x in figs[w]["tokens/s"]) for w in WAYS) + ".")
print()
print("Each phase of a step on the computing thread, from the same traces (mean over both ranks, or")
print("both runs, and every traced step, so that the phases add up to the step less the gaps between")
print("them; ms). The blocks' all-gathers run during the first microbatch's forward and the")
print("reduce-scatters during the second's backward, whose span ends when the last reduce-scatter is")
print("done; the other two phases communicate nothing.")
print()
print("| phase | " + " | ".join(WAYS.values()) + " | dp = 2 less communication-free |")
print("|---|" + "---:|" * (len(WAYS) + 1))
for p in PHASES:
    a, b = (statistics.mean(ph[w][p]) for w in WAYS)
    print(f"| {p} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")

# Each collective of the dp = 2 runs from the later rank's issue to the later rank's completion:
# how long the pair took once both had asked (the communicator's worker runs them in order, so it
# includes waiting behind the one before).
lat = collections.defaultdict(list)
for r in range(1, rounds + 1):
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in spans(f"{work}/dp2-{r}-0/trace.json"):
        if str(e.get("cat", "")).startswith("comm"):
            by[e["name"]][e["pid"]].append(e)
    for name, ranks in by.items():
        if len(ranks) != 2:
            continue
        a, b = (sorted(v, key=lambda e: e["ts"]) for v in ranks.values())
        for x, y in zip(a, b):
            lat[name].append((max(x["ts"] + x["dur"], y["ts"] + y["dur"]) - max(x["ts"], y["ts"])) / 1e3)
print()
print("Each collective of the dp = 2 runs, from the later rank's issue to the later rank's completion (ms;")
print("every traced step of every round; a collective waits behind the one its communicator runs before it):")
print()
print("| collective | median | mean | max | over 2 ms |")
print("|---|---:|---:|---:|---:|")
for name in sorted(lat, key=lambda n: (n.split()[0], n)):
    v = lat[name]
    print(f"| {name} | {statistics.median(v):.2f} | {statistics.mean(v):.2f} | {max(v):.2f} | "
          f"{100 * sum(x > 2 for x in v) / len(v):.0f}% |")
PY
mv "$out.tmp" "$out"
echo "wrote $out"
