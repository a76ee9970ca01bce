"""PyTorch's own Gloo (ProcessGroupGloo, the copy inside LibTorch) on the operations and sizes of
bench/comm_bench.cpp, one round, for bench/run_comm_bench.sh. Run under a torchrun-compatible
launcher:  fsdpp launch --nproc N -- python bench/torch_gloo_bench.py [--max-mib 64] [--dtype bfloat16]
Rank 0 prints one JSON line per operation and size; an operation PyTorch refuses is reported with
its error instead of a time.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist


def time_round(iters, op):
    op()  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    secs = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    return secs.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, a.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        size = 4 << 10
        while size <= a.max_mib << 20:
            chunk = size // esize // n
            iters = min(max((64 << 20) // size, 3), 100)
            full, part = torch.ones(chunk * n, dtype=dtype), torch.ones(chunk, dtype=dtype)
            run = {
                "all_gather": lambda: dist.all_gather_into_tensor(full, part),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
                "all_reduce": lambda: dist.all_reduce(full),
            }[op]
            row = {"impl": "torch", "world": n, "op": op, "dtype": a.dtype, "bytes": chunk * n * esize}
            try:
                row["seconds"] = time_round(iters, run)
            except (RuntimeError, ValueError) as e:
                row["error"] = str(e).splitlines()[0]
                # A refused operation leaves every rank in step: none of them ran it.
            if rank == 0:
                print(json.dumps(row), flush=True)
            size *= 4
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
