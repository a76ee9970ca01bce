#!/usr/bin/env bash
# Whether keeping freed host memory pays: glibc's malloc gives freed memory back to the system once
# the free space at a heap's top passes its trim threshold, and maps blocks above its mmap threshold
# afresh each time (the mmap threshold starts at 128 KiB and grows, as large blocks are freed, up
# to 32 MiB; the trim threshold to twice that), so a training step's pages are faulted in and zeroed
# again every step. Fixing both thresholds high (mmap threshold 256 MiB, trim threshold 1 GiB)
# keeps them: `fsdpp run` starts its ranks so (GLIBC_TUNABLES) unless the recipe says
# dist.keep_freed_memory=false. `fsdpp run recipes/moe-small.json` with malloc's own settings
# (false) and with those (true), in alternating order each round: at dp 1 (2 threads), at dp 2 (the recipe's
# placement), and at dp 1 on a larger model (dim 256, FFN 1024, experts 512, 512 tokens a sequence:
# blocks above 32 MiB). Per setting: tokens/s after the warm-up steps, the page faults, system
# CPU time and all CPU time of a step (every process of the run: a full run less a warm-up-only
# run, over the measured steps), and the largest process's peak resident memory; medians over
# rounds.
# Writes bench/results/host_memory.md, or the file given third; the report names the CPU.
#   bash bench/run_host_memory_bench.sh [build-dir] [rounds] [output]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-4}
out=${3:-bench/results/host_memory.md}
source bench/preamble.sh
[ -z "${GLIBC_TUNABLES:-}${MALLOC_MMAP_THRESHOLD_:-}${MALLOC_TRIM_THRESHOLD_:-}" ] \
  || { echo "unset GLIBC_TUNABLES, MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ first: this compares malloc's own settings"; exit 1; }
results=$work/results.txt
: > "$results"
common=(eval.interval=0 checkpoint.interval=0 logging.interval=1 logging.plot=false --overwrite)
large=(model.dim=256 model.ffn_hidden=1024 model.expert_hidden=512 model.max_seq_len=512 data.seq_len=512)

# Runs a command (log file first); prints the minor page faults, system and user CPU seconds of it
# and every process it started, and the largest one's peak resident memory (KiB).
usage() {
  "$python" - "$@" <<'PY'
import resource, subprocess, sys
with open(sys.argv[1], "w") as log:
    subprocess.run(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT, check=True)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(r.ru_minflt, r.ru_stime, r.ru_utime, r.ru_maxrss)
PY
}

one() {  # layout (dp1 | dp2 | large), malloc (own | kept), round
  local layout=$1 malloc=$2 round=$3
  local dir=$work/$layout-$malloc-$round
  local args=(run recipes/moe-small.json "${common[@]}") warmup=5 steps=20 tokens=$((32 * 128))
  [ "$layout" = dp1 ] && args+=(parallel.dp=1)
  [ "$layout" = large ] && { args+=(parallel.dp=1 "${large[@]}"); warmup=3; steps=6; tokens=$((32 * 512)); }
  if [ "$malloc" = kept ]; then args+=(dist.keep_freed_memory=true); else args+=(dist.keep_freed_memory=false); fi
  local short long rate setting
  short=$(usage "$dir-short.log" "$fsdpp" "${args[@]}" logging.output_dir="$dir-short" --stop-after $warmup) \
    || { cat "$dir-short.log"; exit 1; }
  long=$(usage "$dir.log" "$fsdpp" "${args[@]}" logging.output_dir="$dir" --stop-after $((warmup + steps))) \
    || { cat "$dir.log"; exit 1; }
  rate=$("$python" bench/metrics_tokens_per_s.py "$dir/metrics/rank0.jsonl" $warmup $((warmup + steps)) $tokens | cut -d' ' -f1)
  setting=$(grep -m1 -o 'host memory: .*' "$dir.log" | tr ' ' '~')  # as the rank reports it, one field
  echo "$layout $malloc $warmup $steps $rate $short $long $setting" >> "$results"
}

for round in $(seq "$rounds"); do
  for layout in dp1 dp2 large; do
    if (( round % 2 )); then order="kept own"; else order="own kept"; fi
    for malloc in $order; do
      one "$layout" "$malloc" "$round"
      echo "round $round/$rounds: $(tail -1 "$results")" >&2
    done
  done
done

"$python" - "$results" "$rounds" "$cpu" "$build" > "$out.tmp" <<'PY'
import collections, datetime, statistics, sys
path, rounds, cpu, build = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = collections.defaultdict(list)
measured = {}  # layout: the steps its tokens/s is over
reported = {}  # malloc: what the ranks reported
for line in open(path):
    layout, malloc, warmup, steps, rate, f0, s0, u0, m0, f1, s1, u1, m1, setting = line.split()
    warmup, steps = int(warmup), int(steps)
    measured[layout] = f"steps {warmup + 1}-{warmup + steps}"
    reported[malloc] = setting.replace("~", " ")
    rows[(layout, malloc)].append(dict(rate=float(rate), faults=(int(f1) - int(f0)) / steps,
                                       sys_ms=1e3 * (float(s1) - float(s0)) / steps,
                                       cpu_ms=1e3 * (float(s1) + float(u1) - float(s0) - float(u0)) / steps,
                                       rss_mib=int(m1) / 1024))
med = lambda layout, malloc, k: statistics.median(r[k] for r in rows[(layout, malloc)])
ratios = lambda layout, k: [a[k] / b[k] for a, b in zip(rows[(layout, "kept")], rows[(layout, "own")])]
print("# Keeping freed host memory: malloc's own thresholds against fixed high ones\n")
print(f"Command: `bash bench/run_host_memory_bench.sh {build} {rounds}` ({datetime.date.today()}), 2 cores of {cpu}, "
      "OPENBLAS_* as set by the machine.\n")
print("`fsdpp run recipes/moe-small.json` with `dist.keep_freed_memory=false` (\"own\": the ranks report "
      f"`{reported['own']}`) and `true`, the default (\"kept\": `{reported['kept']}`, "
      "blocks up to 256 MiB from the heaps, and up to 1 GiB of free space kept by each heap "
      "instead of given back to the system), alternating which goes first each round. dp 1 with 2 "
      f"threads and dp 2 as the recipe places it: global batch 32 x 128 tokens, tokens/s over {measured['dp1']}; "
      "the larger model at dp 1 (`model.dim=256 model.ffn_hidden=1024 model.expert_hidden=512`, "
      f"512 tokens a sequence, some blocks above malloc's 32 MiB): {measured['large']}. Per step: a full run less a "
      "warm-up-only run, over the measured steps, of every process of the run (getrusage of the children): "
      "minor page faults, system CPU time, and all CPU time (user and system, both threads or both "
      "ranks); peak memory: the largest process's peak resident set. Medians over rounds; \"kept / own\" "
      "is the median of the rounds' ratios.\n")
print("| run | malloc | tokens/s | page faults a step | system CPU a step | CPU a step | peak memory | kept / own tokens/s, each round |")
print("|---|---|---:|---:|---:|---:|---:|---|")
names = (("dp1", "moe-small, dp 1, 2 threads"), ("dp2", "moe-small, dp 2"), ("large", "larger model, dp 1, 2 threads"))
for layout, name in names:
    for malloc in ("own", "kept"):
        each = " ".join(f"{r:.3f}" for r in ratios(layout, "rate")) if malloc == "kept" else ""
        print(f"| {name} | {malloc} | {med(layout, malloc, 'rate'):.0f} | {med(layout, malloc, 'faults'):.0f} | "
              f"{med(layout, malloc, 'sys_ms'):.1f} ms | {med(layout, malloc, 'cpu_ms'):.1f} ms | "
              f"{med(layout, malloc, 'rss_mib'):.0f} MiB | {each} |")
print()
for layout, name in names:
    print(f"- {name}: kept / own tokens/s **{statistics.median(ratios(layout, 'rate')):.3f}x**, CPU a step "
          f"{statistics.median(ratios(layout, 'cpu_ms')):.3f}x; page faults a step {med(layout, 'own', 'faults'):.0f} -> "
          f"{med(layout, 'kept', 'faults'):.0f}, system CPU a step {med(layout, 'own', 'sys_ms'):.1f} -> "
          f"{med(layout, 'kept', 'sys_ms'):.1f} ms; peak memory {med(layout, 'own', 'rss_mib'):.0f} -> "
          f"{med(layout, 'kept', 'rss_mib'):.0f} MiB.")
PY
mv "$out.tmp" "$out"
cat "$out"
