"""fsdpp's built-in schedules against PyTorch's own: for every schedule class that
torch.distributed.pipelining ships, the per-rank compute order (F, B, I, W) that fsdpp lowers equals
the one PyTorch generates, for pp 2 and 4 and several microbatch counts (odd ones where the
schedule allows them).

PyTorch's orders come from its schedule classes, built on stub stages (the schedule only reads their
indices); fsdpp's from `fsdpp schedule show`, whose CSV is the lowered program (its sends and
receives are left out here).

Usage: test_torch_orders.py FSDPP_BINARY   (run by ctest with the project's Python)
"""
import csv
import inspect
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed.pipelining.schedules as S

FSDPP = sys.argv[1]

# PyTorch class -> (fsdpp schedule, stages per rank, layout)
PAIRS = {
    "ScheduleGPipe": ("GPipe", 1, "loop"),
    "Schedule1F1B": ("1F1B", 1, "loop"),
    "ScheduleInterleaved1F1B": ("Interleaved1F1B", 2, "loop"),
    "ScheduleLoopedBFS": ("LoopedBFS", 2, "loop"),
    "ScheduleInterleavedZeroBubble": ("InterleavedZeroBubble", 2, "loop"),
    "ScheduleZBVZeroBubble": ("ZBVZeroBubble", 2, "v"),
}
# PyTorch schedules fsdpp does not have yet: named in the output, never silently passed over.
MISSING = {"ScheduleDualPipeV": "fsdpp has no DualPipeV schedule yet"}


class StubStage:
    """What a schedule's constructor reads of a stage."""

    def __init__(self, index, num_stages, pp):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = None


def is_compute(token):
    return token[-1:].isdigit() and not any(k in token for k in ("SEND", "RECV", "OVERLAP", "(")) and \
        any(t in token.rstrip("0123456789").lstrip("0123456789") for t in ("F", "B", "I", "W"))


def torch_order(cls, pp, v, m, layout):
    n = pp * v
    indices = [0, 2 * pp - 1] if layout == "v" else [k * pp for k in range(v)]
    stages = [StubStage(i, n, pp) for i in indices]
    single = issubclass(cls, S.PipelineScheduleSingle)
    schedule = cls(stages[0], m) if single else cls(stages, m)
    return {r: [str(a) for a in actions if a is not None and is_compute(str(a))]
            for r, actions in schedule.pipeline_order.items()}


def fsdpp_order(name, pp, v, m, out):
    subprocess.run([FSDPP, "schedule", "show", "--schedule", name, "--pp", str(pp), "--stages-per-rank", str(v),
                    "--microbatches", str(m), "--out", out], check=True, capture_output=True)
    with open(out + ".csv") as f:
        return {r: [a for a in row if a and is_compute(a)] for r, row in enumerate(csv.reader(f))}


def off_by_one_1f1b(torch_ranks, ours, pp):
    """PyTorch 2.15's Schedule1F1B IR numbers the last rank's forwards 1..m instead of 0..m-1 (its
    runtime does not use this IR). True when that is the only difference."""
    last = pp - 1
    if any(torch_ranks[r] != ours.get(r) for r in torch_ranks if r != last):
        return False
    fixed = []
    for a in torch_ranks[last]:
        stage, rest = a.split("F", 1) if "F" in a else (None, None)
        fixed.append(f"{stage}F{int(rest) - 1}" if stage is not None else a)
    return fixed == ours.get(last)


def main():
    shipped = sorted(name for name, c in inspect.getmembers(S, inspect.isclass)
                     if name.startswith("Schedule") and issubclass(c, S._PipelineSchedule) and c.__module__ == S.__name__)
    print(f"PyTorch {torch.__version__} ships: {', '.join(shipped)}")
    failures = []
    unknown = [n for n in shipped if n not in PAIRS and n not in MISSING]
    if unknown:
        failures.append(f"PyTorch schedules neither compared nor listed as missing: {unknown}")
    for name, why in MISSING.items():
        print(f"not compared: {name} ({why})")
    compared = 0
    with tempfile.TemporaryDirectory() as tmp:
        for cls_name in shipped:
            if cls_name not in PAIRS:
                continue
            ours_name, v, layout = PAIRS[cls_name]
            for pp in (2, 4):
                for m in (pp, 2 * pp, 2 * pp + 1):
                    what = f"{cls_name} vs {ours_name}, pp {pp}, {v} stage(s) per rank, {m} microbatches"
                    try:
                        theirs = torch_order(getattr(S, cls_name), pp, v, m, layout)
                    except ValueError as e:  # a microbatch count PyTorch refuses
                        print(f"{what}: PyTorch refuses ({e})")
                        continue
                    try:
                        ours = fsdpp_order(ours_name, pp, v, m, os.path.join(tmp, "o"))
                    except subprocess.CalledProcessError as e:
                        failures.append(f"{what}: PyTorch accepts it, fsdpp refuses: {e.stdout.decode()}{e.stderr.decode()}")
                        continue
                    compared += 1
                    if all(theirs[r] == ours.get(r) for r in theirs) and len(ours) == len(theirs):
                        print(f"{what}: same order on all {pp} ranks")
                    elif cls_name == "Schedule1F1B" and off_by_one_1f1b(theirs, ours, pp):
                        print(f"{what}: same order (PyTorch's IR numbers rank {pp - 1}'s forwards from 1)")
                    else:
                        bad = next(r for r in theirs if theirs[r] != ours.get(r))
                        failures.append(f"{what}: rank {bad} differs:\n  PyTorch {theirs[bad]}\n  fsdpp   {ours.get(bad)}")
    print(f"{compared} (schedule, pp, microbatches) cases compared")
    if compared < 20:
        failures.append(f"only {compared} cases were compared")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
