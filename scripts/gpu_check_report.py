#!/usr/bin/env python3
"""The comparisons and figures of scripts/gpu-check.sh, one markdown line (or table) each, printed.
Exits 1 when a comparison fails, so the step that called it fails.

    gpu_check_report.py equal RUN_A RUN_B            per-step losses bitwise equal (eager vs graph)
    gpu_check_report.py close REF RUN TOL            per-step losses within TOL (relative) of REF's
    gpu_check_report.py speed EAGER GRAPH            median step, eager against graph replay
    gpu_check_report.py big RUN TORCH_JSON CONFIG GPU_NAME
                                                     tokens/s and MFU, fsdpp against PyTorch

A RUN is an output directory of `fsdpp run` (metrics/rank0.jsonl, summary.json). Tokens/s are
computed alike on both sides, from the median step (batch x seq_len / median step time).
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

# Dense bfloat16 peak of the lent cards (NVIDIA's data sheets, SXM parts): MFU's denominator.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}


def losses(run):
    out = {}
    with open(os.path.join(run, "metrics", "rank0.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "loss" in m:
                out[m["step"]] = m["loss"]
    if not out:
        raise SystemExit(f"{run}: no training losses in metrics/rank0.jsonl")
    return out


def summary(run):
    with open(os.path.join(run, "summary.json")) as f:
        return json.load(f)


def name(run):
    return os.path.basename(os.path.normpath(run))


def equal(a, b):
    la, lb = losses(a), losses(b)
    differ = [s for s in sorted(la) if s not in lb or la[s] != lb[s]]
    ok = not differ and la.keys() == lb.keys()
    first = f"; first difference at step {differ[0]}: {la[differ[0]]!r} vs {lb.get(differ[0])!r}" if differ else ""
    print(f"- {name(a)} vs {name(b)}: {len(la)} per-step losses {'bitwise equal' if ok else 'DIFFER'}"
          f" (last {la[max(la)]!r}){first}")
    return ok


def close(ref, run, tol):
    lr, lx = losses(ref), losses(run)
    worst_step, worst = None, 0.0
    for s, v in lr.items():
        if s not in lx:
            print(f"- {name(run)} vs {name(ref)}: step {s} missing")
            return False
        rel = abs(lx[s] - v) / max(abs(v), 1e-12)
        if rel >= worst:
            worst_step, worst = s, rel
    ok = worst <= tol and lx.keys() == lr.keys()
    print(f"- {name(run)} vs {name(ref)}: {len(lr)} per-step losses, largest relative difference {worst:.2e} "
          f"at step {worst_step} ({'within' if ok else 'NOT within'} {tol:g})")
    return ok


def speed(eager, graph):
    e, g = summary(eager), summary(graph)
    print(f"- {name(eager)} / {name(graph)}: median step {e['step_ms_median']:.2f} ms eager, "
          f"{g['step_ms_median']:.2f} ms graph replay: {e['step_ms_median'] / g['step_ms_median']:.2f}x")
    return True


def big(run, torch_json, config_path, gpu):
    """Either side may be missing (a run that failed or timed out): the other is still reported."""
    from model_flops import macs_per_token  # bench/model_flops.py: the matrix products' work per token
    rows, ours, theirs, batch, seq = [], None, None, None, None
    if os.path.exists(os.path.join(run, "summary.json")):
        s = summary(run)
        recipe = json.load(open(os.path.join(run, "recipe.json")))
        batch, seq = recipe["train"]["global_batch"], recipe["data"]["seq_len"]
        ours = batch * seq / (s["step_ms_median"] / 1e3)
        rows.append(("fsdpp (fully_shard, CUDA graph)", s["step_ms_median"], ours))
    lines = [l for l in open(torch_json).read().splitlines() if l.startswith("{")] if os.path.exists(torch_json) else []
    if lines:
        t = json.loads(lines[-1])
        theirs, batch, seq = t["tokens_per_s"], t["batch"], t["seq"]
        rows.append((f"PyTorch {t['torch']} fully_shard", t["step_ms_median"], theirs))
    if not rows:
        print("- neither fsdpp's nor PyTorch's run left figures (see their logs)")
        return False
    flop_per_token = 3 * 2 * sum(macs_per_token(json.load(open(config_path)), seq).values())
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in gpu), None)
    print(f"| {gpu}, batch {batch} x {seq} | median step | tokens/s | MFU |")
    print("|---|---|---|---|")
    for label, ms, tok in rows:
        mfu = f"{100 * tok * flop_per_token / peak:.1f}%" if peak else "(peak unknown)"
        print(f"| {label} | {ms:.1f} ms | {tok:,.0f} | {mfu} |")
    print()
    if ours and theirs:
        print(f"fsdpp / PyTorch: {ours / theirs:.2f}x (training FLOP per token {flop_per_token / 1e9:.3f} G)")
    else:
        print(f"- {'PyTorch' if ours else 'fsdpp'}'s run left no figures (see its log)")
    return True


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "equal":
        ok = equal(*args)
    elif cmd == "close":
        ok = close(args[0], args[1], float(args[2]))
    elif cmd == "speed":
        ok = speed(*args)
    elif cmd == "big":
        ok = big(*args)
    else:
        raise SystemExit(f"unknown command {cmd}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
