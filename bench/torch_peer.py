"""PyTorch's side of bench/run_pytorch_bench.sh: fsdpp's MoE model (tests/fsdp/torch_moe.py, the
same parameters and operations) trained by PyTorch 2.15 the way a PyTorch user would, with the
trainer's batch, optimizer and clipping, printing one JSON line of throughput.

    torch_peer.py train --mode fsdp|ddp --config C ...   (under `fsdpp launch --nproc 2`)
    torch_peer.py train --mode eager|compile --config C  (one process, --threads 2)
    torch_peer.py pp --config C --microbatches 4 [--schedule 1F1B|Interleaved1F1B|ZBVZeroBubble]
                                                         (under `fsdpp launch --nproc 2`)
    torch_peer.py unit-cost                              (200 tiny fully_shard units, one rank)
    torch_peer.py profile --mode eager --config C        (train's steps after --warmup under torch.profiler)

What PyTorch is given: torch.optim.AdamW (its default implementation for CPU tensors), lr 3e-3,
betas (0.9, 0.95), weight decay 0.1 on matrices, torch.nn.utils.clip_grad_norm_(1.0); threads:
1 per rank at world 2 (the launcher's OMP_NUM_THREADS=1), --threads in one process; `compile`:
torch.compile(model) with its defaults (inductor, mode "default"); the model's auxiliary losses
are attached where they arise, as fsdpp's are. Batches are windows of the same corpus as the fsdpp
recipe (the fortunes), seeded.

--dtype bfloat16 computes in bfloat16 the way PyTorch offers for each mode: `fsdp` with
fully_shard's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), as fsdpp's
precision.param_dtype and reduce_dtype do; `eager`, `compile` and `ddp` with the forward under
torch.autocast("cpu", dtype=bfloat16) (products in bfloat16, parameters and optimizer in float32).

Throughput: tokens of the global batch per second, over the steps after --warmup (timed from the
first measured step's start to the last one's end, the host synchronised by loss.item() each step
as fsdpp's trainer does).
"""
import argparse
import contextlib
import glob
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fsdp"))
import torch_moe  # noqa: E402


def corpus():
    files = sorted(f for f in glob.glob("/usr/share/games/fortunes/*") if "." not in os.path.basename(f))
    data = b"".join(open(f, "rb").read() for f in files) if files else open(__file__, "rb").read()
    return torch.tensor(list(data), dtype=torch.int64)


def batches(text, count, rows, seq, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        starts = torch.randint(0, len(text) - seq - 1, (rows, 1), generator=g)
        yield text[starts + torch.arange(seq + 1)]


def optimizer(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)


def report(args, mode, times, tokens_per_step, loss, world):
    measured = times[args.warmup:]
    seconds = sum(measured)
    impl = f"pytorch-{mode}" + ("-bf16" if args.dtype == "bfloat16" else "")
    print(json.dumps({"impl": impl, "torch": torch.__version__, "world": world,
                      "threads": torch.get_num_threads(), "steps": len(measured),
                      "tokens_per_s": tokens_per_step * len(measured) / seconds,
                      "step_ms_median": 1e3 * sorted(measured)[len(measured) // 2], "last_loss": loss}), flush=True)


def train(args):
    distributed = args.mode in ("fsdp", "ddp")
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        torch.set_num_threads(args.threads)
        rank, world = 0, 1
    config = json.load(open(args.config))
    torch.manual_seed(args.seed)
    model = torch_moe.MoETransformer(config)
    torch_moe.attach_aux(model, 1.0 / args.accum)
    bf16 = args.dtype == "bfloat16"
    if args.mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.layers:
            fully_shard(block, reshard_after_forward=args.reshard_after_forward, mp_policy=mp)
        fully_shard(model, reshard_after_forward=args.reshard_after_forward, mp_policy=mp)
        step_model = model
    elif args.mode == "ddp":
        step_model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.mode == "compile":
        step_model = torch.compile(model, dynamic=True)
    else:
        step_model = model
    opt = optimizer(model)
    rows = args.global_batch // (world * args.accum)
    text = corpus()
    times, loss_value = [], 0.0
    data = batches(text, (args.warmup + args.steps) * args.accum * world, rows, args.seq, args.seed + 1)
    measured = contextlib.ExitStack()
    for step in range(args.warmup + args.steps):
        if step == args.warmup and args.what == "profile":  # the measured steps under torch.profiler
            from torch.profiler import ProfilerActivity, profile as torch_profile
            prof = measured.enter_context(torch_profile(activities=[ProfilerActivity.CPU]))
        micro = [next(data) for _ in range(args.accum * world)][rank::world]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for j, b in enumerate(micro):
            last = j + 1 == len(micro)
            if args.mode == "fsdp":
                model.set_requires_gradient_sync(last)
                if not args.reshard_after_forward:  # keep the gathered blocks through the no-sync microbatches
                    model.set_reshard_after_backward(last)
            context = step_model.no_sync() if args.mode == "ddp" and not last else contextlib.nullcontext()
            autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16 and args.mode != "fsdp"
                        else contextlib.nullcontext())
            with context:
                with autocast:
                    loss = torch_moe.lm_loss(step_model(b[:, :-1]), b[:, 1:])
                (loss / args.accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = (total / args.accum).item()
        times.append(time.perf_counter() - t0)
    measured.close()
    if rank == 0 and args.what == "profile":
        profile_report(args, prof)
    elif rank == 0:
        report(args, args.mode, times, args.global_batch * args.seq, loss_value, world)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def profile_report(args, prof):
    """Self time of each operation over the measured steps: the share that matrix multiplies take
    bounds what any implementation running the same matrix-multiply kernels can gain, 1 / share,
    however well it fuses the rest."""
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(self_us.values())
    matmul = sum(v for k, v in self_us.items() if k in MATMUL_OPS)
    attention = sum(v for k, v in self_us.items() if k in ATTENTION_OPS)
    top = sorted(self_us.items(), key=lambda kv: -kv[1])[:12]
    print(json.dumps({"impl": f"pytorch-{args.mode}-profile", "threads": args.threads, "steps": args.steps,
                      "step_ms": total / args.steps / 1e3, "matmul_share": matmul / total,
                      "attention_share": attention / total, "ceiling": total / matmul,
                      "top": [[k, v / total] for k, v in top]}))


class Part(torch.nn.Module):
    """Layers [first, last) of the model, with the embedding when first == 0 and the final norm and
    head when last == layers: a pipeline stage cut as fsdpp cuts one."""

    def __init__(self, model, first, last):
        super().__init__()
        self.embed = model.embed if first == 0 else None
        self.layers = torch.nn.ModuleList(model.layers[first:last])
        self.norm, self.head = (model.norm, model.head) if last == len(model.layers) else (None, None)

    def forward(self, h):
        if self.embed is not None:
            h = self.embed(h)
        for block in self.layers:
            h = block(h)
        if self.head is not None:
            return self.head(self.norm(h)).float()
        # A block returns a view (its output with the auxiliary losses attached), which the split
        # backward of ZBVZeroBubble cannot detach in place; a copy of the 0.5 MiB activation can.
        return h.clone() if h._is_view() else h


def pipelined(args):
    from torch.distributed import pipelining
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("pp: run with 2 ranks")
    config = torch_moe.full_config(json.load(open(args.config)))
    torch.manual_seed(args.seed)
    model = torch_moe.MoETransformer(config)
    torch_moe.attach_aux(model, 1.0 / args.microbatches)
    # Stages as fsdpp places them: 1F1B one per rank; Interleaved1F1B rank r holds r and r + 2;
    # ZBVZeroBubble the V, rank 0 holding the first and the last.
    stages_per_rank = 1 if args.schedule == "1F1B" else 2
    n = world * stages_per_rank
    mine = {"1F1B": [rank], "Interleaved1F1B": [rank, rank + 2], "ZBVZeroBubble": [rank, n - 1 - rank]}[args.schedule]
    layers, rows = config["layers"], args.global_batch // args.microbatches
    stages, modules = [], []
    for s in mine:
        module = Part(model, layers * s // n, layers * (s + 1) // n)
        example = torch.zeros(rows, args.seq, dtype=torch.long) if s == 0 else torch.zeros(rows, args.seq, config["dim"])
        stages.append(pipelining.PipelineStage(module, s, n, torch.device("cpu"), input_args=(example,)))
        modules.append(module)
    del model  # the other rank's layers, as fsdpp drops them once its stages are cut
    loss_fn = lambda logits, y: torch_moe.lm_loss(logits, y)  # noqa: E731
    if args.schedule == "1F1B":
        schedule = pipelining.Schedule1F1B(stages[0], args.microbatches, loss_fn=loss_fn)
    else:
        kind = {"Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
                "ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble}[args.schedule]
        schedule = kind(stages, args.microbatches, loss_fn=loss_fn)
    parameters = [p for m in modules for p in m.parameters()]
    opt = optimizer(torch.nn.ModuleList(modules))
    text = corpus()
    first, last = 0 in mine, n - 1 in mine
    times, loss_value = [], 0.0
    for step, b in enumerate(batches(text, args.warmup + args.steps, args.global_batch, args.seq, args.seed + 1)):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        losses = []
        inputs = (b[:, :-1].contiguous(),) if first else ()
        targets = {"target": b[:, 1:].contiguous(), "losses": losses} if last else {}
        schedule.step(*inputs, **targets)
        # The global gradient norm over all stages, as one would clip a pipelined model.
        local = torch.stack([p.grad.detach().pow(2).sum() for p in parameters if p.grad is not None]).sum()
        dist.all_reduce(local)
        scale = torch.clamp(1.0 / (local.sqrt() + 1e-6), max=1.0)
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)
        opt.step()
        loss_value = torch.stack(losses).mean().item() if losses else 0.0
        times.append(time.perf_counter() - t0)
    if last:
        report(args, f"pp-{args.schedule}", times, args.global_batch * args.seq, loss_value, world)
    dist.barrier()
    dist.destroy_process_group()


def unit_cost(args):
    """Microseconds of FSDP bookkeeping per unit per step: 200 Linear(8, 8), each its own
    fully_shard unit, one rank, against the same model unsharded (rounds alternating)."""
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)

    def tiny():
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(200)])

    plain, sharded = tiny(), tiny()
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    x = torch.randn(4, 8)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain, sharded)]

    def round_of(i):
        model, opt = (plain, sharded)[i], opts[i]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return (time.perf_counter() - t0) / args.steps

    for _ in range(3):
        round_of(0), round_of(1)
    tp, ts = [], []
    for _ in range(7):
        tp.append(round_of(0))
        ts.append(round_of(1))
    p, s = sorted(tp)[3], sorted(ts)[3]
    print(json.dumps({"impl": "pytorch-unit-cost", "units": 200, "plain_step_us": 1e6 * p, "sharded_step_us": 1e6 * s,
                      "us_per_unit_per_step": 1e6 * (s - p) / 200}), flush=True)
    dist.destroy_process_group()


def main():
    # The blocks return their input's identity with the auxiliary losses attached (a view); nothing
    # modifies it in place, which is what this warning is about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["train", "pp", "unit-cost", "profile"])
    ap.add_argument("--mode", choices=["fsdp", "ddp", "eager", "compile"], default="eager")
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "moe-small.json"))
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=["1F1B", "Interleaved1F1B", "ZBVZeroBubble"], default="1F1B",
                    help="pp: the pipeline schedule")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reshard-after-forward", type=lambda v: v == "true", default=True,
                    help="fsdp mode: true (FSDP2's default) or false (gather each block once per step)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="train: compute dtype (bfloat16: fully_shard's MixedPrecisionPolicy, else autocast)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    {"train": train, "pp": pipelined, "unit-cost": unit_cost, "profile": train}[args.what](args)
    torch_moe.exit_rank()


if __name__ == "__main__":
    main()
