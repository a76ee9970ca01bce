#!/usr/bin/env bash
# The trainer's acceptance figures: the default recipe end to end (wall time, tokens/s, losses),
# and the first 20 steps of the same model at three layouts (dp=2; pp=2 with 1F1B; dp=2 x pp=2),
# which must agree within float tolerance. Writes bench/results/trainer.md.
#   bash bench/run_trainer_bench.sh [build-dir]
# Runs with the machine's OPENBLAS_* settings as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
source bench/preamble.sh
out=bench/results/trainer.md

start=$(date +%s)
"$build/fsdpp" run recipes/moe-small.json logging.output_dir="$work/default" --overwrite > "$work/default.log"
end=$(date +%s)
wall=$((end - start))

for r in moe-small moe-small-pp moe-small-2d; do
  "$build/fsdpp" run recipes/$r.json logging.output_dir="$work/$r" logging.interval=1 eval.interval=0 \
    checkpoint.interval=0 --stop-after 20 > "$work/$r.log"
done

python3 - "$work" "$wall" "$build" > "$out.tmp" <<'PY'
import json, os, sys, datetime
work, wall, build = sys.argv[1], float(sys.argv[2]), sys.argv[3]
def metrics(run):
    rows = [json.loads(l) for l in open(os.path.join(work, run, "metrics", "rank0.jsonl"))]
    return {r["step"]: r for r in rows if "loss" in r}, {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
s = json.load(open(os.path.join(work, "default", "summary.json")))
train, val = metrics("default")
print("# Trainer")
print()
print(f"Command: `bash bench/run_trainer_bench.sh {build}` ({datetime.date.today()}), 2 cores, OPENBLAS_* as set by the machine.")
print()
print("## Default recipe (`fsdpp run recipes/moe-small.json`: MoE 4 experts top-2, 1.36M parameters, dp=2, fortunes)")
print()
print(f"- wall time of the whole command (start of ranks, data, {s['steps']} steps, evaluations, checkpoints): **{wall:.0f} s**")
print(f"- training throughput: {s['tokens_per_s']:.0f} tokens/s over both ranks")
print(f"- final training loss {s['train_loss']:.4f}, validation loss **{s['val_loss']:.4f} nats/byte** ({s['val_loss']/0.6931:.3f} bits/byte); start: ln 256 = 5.545")
print()
print("| step | validation loss (nats/byte) |")
print("|---:|---:|")
for k in sorted(val): print(f"| {k} | {val[k]:.4f} |")
print()
print("## Same model and batches at three layouts, first 20 steps")
print()
print("`moe-small` (dp=2, grad_accum=2), `moe-small-pp` (pp=2, 1F1B, 4 microbatches, max 2 sends in")
print("flight), `moe-small-2d` (dp=2 x pp=2, 2 microbatches): every microbatch is the same 8 sequences,")
print("so the losses differ only by floating-point summation order. Each run: `--stop-after 20` (the")
print("1000-step learning-rate schedule).")
print()
print("| step | dp=2 | pp=2 | dp=2 x pp=2 | max relative difference |")
print("|---:|---:|---:|---:|---:|")
a, b, c = (metrics(r)[0] for r in ("moe-small", "moe-small-pp", "moe-small-2d"))
worst = 0
for k in sorted(a):
    la, lb, lc = a[k]["loss"], b[k]["loss"], c[k]["loss"]
    d = max(abs(lb - la), abs(lc - la)) / abs(la)
    worst = max(worst, d)
    print(f"| {k} | {la:.6f} | {lb:.6f} | {lc:.6f} | {d:.1e} |")
print()
print(f"Largest relative difference over the 20 steps: {worst:.1e}.")
print()
print("Throughput over these 20 steps (tokens/s, last logged step): " + ", ".join(
    f"{r} {m[20]['tokens_per_s']:.0f}" for r, m in (("dp=2", a), ("pp=2", b), ("dp=2 x pp=2", c))) + ".")
PY
mv "$out.tmp" "$out"
cat "$out"
