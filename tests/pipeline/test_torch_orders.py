"""fsdpp's built-in schedules against PyTorch's own.

1. Orders: for every schedule class that torch.distributed.pipelining ships, the per-rank compute
   order (F, B, I, W) that fsdpp lowers equals the one PyTorch generates, for pp 2 and 4 and several
   microbatch counts (odd ones where the schedule allows them), DualPipeV's OVERLAP_F_B groups
   included (fsdpp's tables write them as PyTorch does, "(0F1;3B0)OVERLAP_F_B").
2. Action tables, both ways: a compute-only CSV that PyTorch's runtime writes (_dump_csv) loads in
   `fsdpp schedule show --csv` with the same order, and the compute CSV fsdpp writes loads in
   PyTorch's runtime (_load_csv, which lowers it with PyTorch's own passes) with the same order.
   tests/pipeline/torch_zbv_pp2_m4.csv, which the executor test runs, is checked to be what
   PyTorch writes.
3. Lowered programs, for PyTorch's runtime schedules: between every pair of ranks the same messages
   in the same order (sent and received), and on every rank the same UNSHARD, RESHARD and
   REDUCE_GRAD actions after the same number of computations (fsdpp lowered with --fsdp), also
   with max_active_stages 1 to 3 and unshard_lookahead "full", "auto" and one value per rank; and
   under a send budget (max_outstanding_sends 1 to 3), the whole program action for action.

PyTorch's orders come from its schedule classes, built on stub stages (the schedule only reads their
indices); fsdpp's from `fsdpp schedule show`.

Usage: test_torch_orders.py FSDPP_BINARY   (run by ctest with the project's Python)
"""
import csv
import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch
import torch.distributed.pipelining.schedules as S

FSDPP = sys.argv[1] if len(sys.argv) > 1 else "fsdpp"
HERE = os.path.dirname(os.path.abspath(__file__))

# PyTorch class -> (fsdpp schedule, stages per rank, layout)
PAIRS = {
    "ScheduleGPipe": ("GPipe", 1, "loop"),
    "Schedule1F1B": ("1F1B", 1, "loop"),
    "ScheduleInterleaved1F1B": ("Interleaved1F1B", 2, "loop"),
    "ScheduleLoopedBFS": ("LoopedBFS", 2, "loop"),
    "ScheduleInterleavedZeroBubble": ("InterleavedZeroBubble", 2, "loop"),
    "ScheduleZBVZeroBubble": ("ZBVZeroBubble", 2, "v"),
    "ScheduleDualPipeV": ("DualPipeV", 2, "v"),
}
# PyTorch schedules fsdpp does not have yet: named in the output, never silently passed over.
MISSING = {}


class StubStage:
    """What a schedule's constructor reads of a stage."""

    def __init__(self, index, num_stages, pp):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = None


def is_compute(token):
    """F, B, I or W of a stage and microbatch ("2F0", "0W3"), or an overlap group of them
    ("(0F1;3B0)OVERLAP_F_B")."""
    return re.fullmatch(r"\d+[FBIW]\d+|\(\d+[FBIW]\d+(;\d+[FBIW]\d+)+\)OVERLAP_F_B", token) is not None


def torch_schedule(cls, pp, v, m, layout, **options):
    n = pp * v
    indices = [0, 2 * pp - 1] if layout == "v" else [k * pp for k in range(v)]
    stages = [StubStage(i, n, pp) for i in indices]
    return cls(stages[0], m, **options) if issubclass(cls, S.PipelineScheduleSingle) else cls(stages, m, **options)


def texts(actions):
    """The actions as a table writes them, an OVERLAP_F_B group in one cell."""
    return [str(a) for a in actions if a is not None]


def compute_of(order):
    return {r: [a for a in texts(actions) if is_compute(a)] for r, actions in order.items()}


def torch_order(cls, pp, v, m, layout):
    return compute_of(torch_schedule(cls, pp, v, m, layout).pipeline_order)


def read_table(path):
    with open(path) as f:
        return {r: [a for a in row if a and is_compute(a)] for r, row in enumerate(csv.reader(f))}


def fsdpp_show(args, pp, v, m, out):
    subprocess.run([FSDPP, "schedule", "show", *args, "--pp", str(pp), "--stages-per-rank", str(v),
                    "--microbatches", str(m), "--out", out], check=True, capture_output=True)
    return read_table(out + ".csv")


def fsdpp_order(name, pp, v, m, out):
    return fsdpp_show(["--schedule", name], pp, v, m, out)


def runtime_schedules():
    """(PyTorch class name, class, fsdpp name, stages per rank, layout) of PyTorch's runtime
    schedules: the ones that read and write action tables and expose a lowered program."""
    for cls_name, (ours_name, v, layout) in PAIRS.items():
        cls = getattr(S, cls_name)
        if issubclass(cls, S._PipelineScheduleRuntime):
            yield cls_name, cls, ours_name, v, layout


def check_tables(tmp, failures):
    """Compute-only CSVs both ways, for PyTorch's runtime schedules (the ones with _load_csv)."""
    cases = 0
    for cls_name, cls, ours_name, v, layout in runtime_schedules():
        for pp in (2, 4):
            m = 2 * pp
            what = f"{cls_name}, pp {pp}, {m} microbatches"
            want = torch_order(cls, pp, v, m, layout)
            theirs = os.path.join(tmp, "torch.csv")
            torch_schedule(cls, pp, v, m, layout)._dump_csv(theirs, format="compute_only")
            try:
                loaded = fsdpp_show(["--csv", theirs], pp, v, m, os.path.join(tmp, "t"))
            except subprocess.CalledProcessError as e:
                failures.append(f"{what}: fsdpp does not load PyTorch's CSV: {e.stdout.decode()}{e.stderr.decode()}")
                continue
            if loaded != want:
                failures.append(f"{what}: PyTorch's CSV loads in fsdpp with another order: {loaded} vs {want}")
            fsdpp_order(ours_name, pp, v, m, os.path.join(tmp, "f"))
            back = torch_schedule(cls, pp, v, m, layout)
            back._load_csv(os.path.join(tmp, "f.compute.csv"), format="compute_only")  # lowered by PyTorch
            if compute_of(back.pipeline_order) != want or not back.pipeline_order_with_comms:
                failures.append(f"{what}: fsdpp's CSV loads in PyTorch with another order")
            cases += 1
            print(f"{what}: PyTorch's CSV loads and lowers in fsdpp, fsdpp's in PyTorch; same orders")
    # The table the executor test runs is what PyTorch writes.
    fixture = os.path.join(HERE, "torch_zbv_pp2_m4.csv")
    written = os.path.join(tmp, "zbv.csv")
    torch_schedule(S.ScheduleZBVZeroBubble, 2, 2, 4, "v")._dump_csv(written, format="compute_only")
    with open(fixture) as a, open(written) as b:
        if a.read() != b.read():
            failures.append(f"{fixture} is not what PyTorch {torch.__version__} writes for ZBVZeroBubble pp 2, m 4")
    return cases


def check_lowered_tables(tmp, failures):
    """Lowered tables (PyTorch's compute_comms format, with WAIT_SEND_F / WAIT_SEND_B) both ways,
    without FSDP: fsdpp's loads as it is in PyTorch's _load_csv(format="compute_comms"), which
    requires one wait per send, and gives the same program; PyTorch's own lowered program, its
    FSDP actions left out, passes fsdpp's checks (the messages, their order between ranks, one wait
    per send) and its simulation."""
    fsdp_action = re.compile(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD|WAIT_REDUCE_GRAD)")
    cases = 0
    for cls_name, cls, ours_name, v, layout in runtime_schedules():
        for pp in (2, 4):
            m = 2 * pp
            what = f"{cls_name}, pp {pp}, {m} microbatches, lowered table"
            out = os.path.join(tmp, "lowered")
            fsdpp_order(ours_name, pp, v, m, out)
            with open(out + ".csv") as f:
                ours = {r: [a for a in row if a] for r, row in enumerate(csv.reader(f))}
            back = torch_schedule(cls, pp, v, m, layout)
            try:
                back._load_csv(out + ".csv", format="compute_comms")
            except Exception as e:  # noqa: BLE001 (PyTorch raises several kinds)
                failures.append(f"{what}: PyTorch refuses fsdpp's lowered table: {e}")
                continue
            loaded = {r: texts(acts) for r, acts in back.pipeline_order_with_comms.items()}
            if loaded != ours:
                failures.append(f"{what}: fsdpp's lowered table loads in PyTorch as another program")
            table = os.path.join(tmp, "torch_lowered.csv")
            with open(table, "w", newline="") as f:
                writer = csv.writer(f)
                theirs = torch_schedule(cls, pp, v, m, layout).pipeline_order_with_comms
                for r in sorted(theirs):
                    writer.writerow([a for a in texts(theirs[r]) if not fsdp_action.fullmatch(a)])
            try:
                fsdpp_show(["--csv", table], pp, v, m, os.path.join(tmp, "theirs"))
            except subprocess.CalledProcessError as e:
                failures.append(f"{what}: fsdpp refuses PyTorch's lowered table: {e.stdout.decode()}{e.stderr.decode()}")
                continue
            cases += 1
            print(f"{what}: fsdpp's loads in PyTorch as the same program, PyTorch's passes fsdpp's checks")
    return cases


def stage_owner(stage, pp, layout):
    return (stage if stage < pp else 2 * pp - 1 - stage) if layout == "v" else stage % pp


def lowered_summary(ranks, pp, layout):
    """What two lowerings must agree on: per (sender, receiver), the messages in the order sent and
    in the order received (NCCL pairs them by order); per rank each FSDP action (UNSHARD,
    RESHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD of a stage) and each send's wait (WAIT_SEND_F,
    WAIT_SEND_B), with the number of compute actions (an overlap group counting as one) before it."""
    sent, received, fsdp, waits = {}, {}, {}, {}
    for r, actions in ranks.items():
        computed = 0
        for a in actions:
            m = re.fullmatch(r"(\d+)(SEND|RECV)_([FB])(\d+)", a)
            if m:
                stage, kind, d, mb = int(m[1]), m[2], m[3], int(m[4])
                peer_stage = stage + 1 if (d == "F") == (kind == "SEND") else stage - 1
                peer = stage_owner(peer_stage, pp, layout)
                message = f"{d} of stage {stage if kind == 'SEND' else peer_stage} mb {mb}"
                key = (r, peer) if kind == "SEND" else (peer, r)
                (sent if kind == "SEND" else received).setdefault(key, []).append(message)
            elif re.fullmatch(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD|WAIT_REDUCE_GRAD)", a):
                fsdp.setdefault(r, []).append(f"{a} after {computed}")
            elif re.fullmatch(r"\d+WAIT_SEND_[FB]\d+", a):
                waits.setdefault(r, []).append(f"{a} after {computed}")
            elif is_compute(a):
                computed += 1
    return sent, received, fsdp, waits


def order_broken(ranks, pp, layout):
    """Whether some rank receives a peer's messages in another order than the peer sends them
    (NCCL pairs a pair's sends and receives by order; fsdpp posts such a receive earlier)."""
    sent, received, _, _ = lowered_summary(ranks, pp, layout)
    return any(sent.get(k) != received.get(k) for k in set(sent) | set(received))


def same_or_reordered(what, theirs, ours, pp, layout, failures):
    """True when the programs are the same; False, and nothing reported, where they differ only
    because PyTorch's receives (with defer_pp_recv) break a pair's message order, which fsdpp's do
    not; otherwise reported."""
    bad = [r for r in theirs if theirs[r] != ours.get(r)]
    if not bad:
        return True
    if order_broken(theirs, pp, layout) and not order_broken(ours, pp, layout):
        return False
    failures.append(f"{what}: rank {bad[0]} differs:\n  PyTorch {theirs[bad[0]]}\n  fsdpp   {ours.get(bad[0])}")
    return False


def compare_lowered(what, theirs, ours_args, pp, v, m, layout, tmp, failures):
    """fsdpp's plan (`schedule show` with ours_args) against PyTorch's lowered program `theirs`:
    the same messages in the same order and the same FSDP actions on every rank. False where fsdpp
    refuses what PyTorch accepts."""
    out = os.path.join(tmp, "l")
    try:
        fsdpp_show(ours_args, pp, v, m, out)
    except subprocess.CalledProcessError as e:
        failures.append(f"{what}: PyTorch accepts it, fsdpp refuses: {e.stdout.decode()}{e.stderr.decode()}")
        return False
    with open(out + ".csv") as f:
        ours = {r: [a for a in row if a] for r, row in enumerate(csv.reader(f))}
    for part, a, b in zip(("sends", "receives", "FSDP actions", "send waits"),
                          lowered_summary(theirs, pp, layout), lowered_summary(ours, pp, layout)):
        if a != b:
            key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            failures.append(f"{what}: {part} differ at {key}:\n  PyTorch {a.get(key)}\n  fsdpp   {b.get(key)}")
    return True


def check_lowered(tmp, failures):
    """Lowered programs (PyTorch's pipeline_order_with_comms against fsdpp's plan with --fsdp), for
    PyTorch's runtime schedules, with defer_reduce_grad_wait false (PyTorch's default) and true
    (fsdpp's): the same messages, the same FSDP actions (WAIT_REDUCE_GRAD included) and the same
    WAIT_SEND_F / WAIT_SEND_B after the same computations; and with defer_pp_recv false and true,
    the whole program, action for action (DualPipeV's OVERLAP_F_B groups included)."""
    cases = exact = reordered = 0
    for cls_name, cls, ours_name, v, layout in runtime_schedules():
        for pp in (2, 4):
            for m in (2 * pp, 2 * pp + 1):
                for defer in (False, True):
                    what = f"{cls_name}, pp {pp}, {m} microbatches, defer_reduce_grad_wait {defer}, lowered"
                    try:
                        sched = torch_schedule(cls, pp, v, m, layout, defer_reduce_grad_wait=defer)
                        theirs = {r: texts(acts) for r, acts in sched.pipeline_order_with_comms.items()}
                    except ValueError:
                        continue  # a count PyTorch refuses
                    args = ["--schedule", ours_name, "--fsdp", "--defer-reduce-grad-wait", str(defer).lower()]
                    if compare_lowered(what, theirs, args, pp, v, m, layout, tmp, failures):
                        cases += 1
                    print(f"{what}: same messages in the same order between every pair of ranks, same FSDP actions "
                          "and send waits")
                    for defer_recv in (False, True):
                        sched = torch_schedule(cls, pp, v, m, layout, defer_reduce_grad_wait=defer,
                                               defer_pp_recv=defer_recv)
                        theirs = {r: texts(acts) for r, acts in sched.pipeline_order_with_comms.items()}
                        out = os.path.join(tmp, "exact")
                        fsdpp_show(args + ["--defer-pp-recv", str(defer_recv).lower()], pp, v, m, out)
                        with open(out + ".csv") as f:
                            ours = {r: [a for a in row if a] for r, row in enumerate(csv.reader(f))}
                        if same_or_reordered(f"{what}, defer_pp_recv {defer_recv}", theirs, ours, pp, layout,
                                             failures):
                            exact += 1
                            print(f"{what}, defer_pp_recv {defer_recv}: the same program, action for action")
                        else:
                            reordered += 1
    return cases, exact, reordered


def check_budget(tmp, failures):
    """max_outstanding_sends: PyTorch's lowering with the budget (its _add_wait_send_budget moving
    WAIT_SEND_F / WAIT_SEND_B earlier) against fsdpp's plan with --max-outstanding-sends, for
    PyTorch's runtime schedules at pp 2 and 4, budgets 1 to 3, receives posted early and late
    (defer_pp_recv), with FSDP actions: the whole program, action for action. Where PyTorch cannot
    keep a budget, fsdpp's plan must still be made (it keeps the budget at run time); those cases
    are counted apart."""
    cases = refused = reordered = 0
    for cls_name, cls, ours_name, v, layout in runtime_schedules():
        for pp in (2, 4):
            m = 2 * pp
            for budget, defer in [(b, d) for b in (1, 2, 3) for d in (False, True)]:
                what = f"{cls_name}, pp {pp}, {m} microbatches, max_outstanding_sends {budget}, defer_pp_recv {defer}"
                args = ["--schedule", ours_name, "--fsdp", "--max-outstanding-sends", str(budget),
                        "--defer-pp-recv", str(defer).lower()]
                try:
                    sched = torch_schedule(cls, pp, v, m, layout, max_outstanding_sends=budget, defer_pp_recv=defer)
                    theirs = {r: texts(acts) for r, acts in sched.pipeline_order_with_comms.items()}
                except ValueError as e:
                    if "Cannot satisfy max_outstanding_sends" not in str(e):
                        failures.append(f"{what}: PyTorch refuses: {e}")
                        continue
                    try:
                        fsdpp_show(args, pp, v, m, os.path.join(tmp, "b"))
                    except subprocess.CalledProcessError as err:
                        failures.append(f"{what}: PyTorch cannot keep the budget and fsdpp refuses: "
                                        f"{err.stdout.decode()}{err.stderr.decode()}")
                    refused += 1
                    continue
                out = os.path.join(tmp, "b")
                try:
                    fsdpp_show(args, pp, v, m, out)
                except subprocess.CalledProcessError as e:
                    failures.append(f"{what}: PyTorch accepts it, fsdpp refuses: {e.stdout.decode()}{e.stderr.decode()}")
                    continue
                with open(out + ".csv") as f:
                    ours = {r: [a for a in row if a] for r, row in enumerate(csv.reader(f))}
                if same_or_reordered(what, theirs, ours, pp, layout, failures):
                    cases += 1
                else:
                    reordered += 1
    print(f"{cases} lowerings under a send budget equal to PyTorch's action for action; {reordered} where PyTorch's "
          f"deferred receives break a pair's message order and fsdpp's do not; {refused} budgets PyTorch cannot keep, "
          "which fsdpp keeps at run time")
    return cases


def check_lookahead(tmp, failures):
    """Staggered unshards: PyTorch's lowering with max_active_stages and unshard_lookahead ("full",
    "auto", one value per rank) against fsdpp's plan with --max-active-stages and
    --unshard-lookahead, for PyTorch's runtime schedules (also with 3 stages per rank where the
    layout allows it): the same UNSHARD and RESHARD actions after the same number of computations
    on every rank, and the same messages."""
    cases = 0
    for cls_name, cls, ours_name, v0, layout in runtime_schedules():
        for pp in (2, 4):
            for v in sorted({v0, 3 if layout == "loop" else v0}):
                m = 2 * pp
                for active in (1, 2, 3):
                    per_rank = tuple(1 + (r * 2 + 1) % active for r in range(pp))
                    for lookahead in ("full", "auto", per_rank):
                        what = (f"{cls_name}, pp {pp}, {v} stages per rank, {m} microbatches, "
                                f"max_active_stages {active}, unshard_lookahead {lookahead}")
                        try:
                            sched = torch_schedule(cls, pp, v, m, layout, max_active_stages=active,
                                                   unshard_lookahead=lookahead)
                            theirs = {r: texts(acts) for r, acts in sched.pipeline_order_with_comms.items()}
                        except ValueError as e:
                            if "max_active_stages" in str(e):
                                continue  # DualPipeV's overlapped pairs need 2 active stages
                            failures.append(f"{what}: PyTorch refuses: {e}")
                            continue
                        text = lookahead if isinstance(lookahead, str) else ",".join(map(str, lookahead))
                        args = ["--schedule", ours_name, "--fsdp", "--max-active-stages", str(active),
                                "--unshard-lookahead", text, "--defer-reduce-grad-wait", "false"]
                        if compare_lowered(what, theirs, args, pp, v, m, layout, tmp, failures):
                            cases += 1
    print(f"{cases} lowerings with max_active_stages and unshard_lookahead compared")
    return cases


def off_by_one_1f1b(torch_ranks, ours, pp):
    """PyTorch 2.15's Schedule1F1B IR numbers the last rank's forwards 1..m instead of 0..m-1 (its
    runtime does not use this IR). True when that is the only difference."""
    last = pp - 1
    if any(torch_ranks[r] != ours.get(r) for r in torch_ranks if r != last):
        return False
    fixed = [re.sub(r"F(\d+)$", lambda f: f"F{int(f.group(1)) - 1}", a) for a in torch_ranks[last]]
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
        tables = check_tables(tmp, failures)
        lowered_tables = check_lowered_tables(tmp, failures)
        lowered, exact, reordered = check_lowered(tmp, failures)
        staggered = check_lookahead(tmp, failures)
        budgets = check_budget(tmp, failures)
    print(f"{compared} (schedule, pp, microbatches) orders compared; {tables} tables and {lowered_tables} lowered "
          f"tables exchanged both ways; {lowered} lowered programs compared, {exact} action for action "
          f"(with receives posted early and late; {reordered} where PyTorch's deferred receives break a pair's message "
          f"order); {staggered} with staggered unshards, {budgets} under a send budget")
    if (compared < 20 or tables < 8 or lowered_tables < 8 or lowered < 16 or exact + reordered < 2 * lowered
            or exact < lowered or staggered < 60 or budgets < 30):
        failures.append(f"only {compared} orders, {tables} tables, {lowered_tables} lowered tables, {lowered} "
                        f"lowered programs and {staggered} staggered lowerings were compared")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
