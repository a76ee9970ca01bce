#!/usr/bin/env python3
"""The reference for fsdpp's GPU figures: the MoE transformer of include/fsdpp/models/moe.hpp as
tests/fsdp/torch_moe.py writes it in PyTorch (the same operations; routing as the config says,
configs/moe-16x2.json: capacity), trained with
PyTorch's own FSDP2 `fully_shard` (each block, then the root), bfloat16 compute with float32
reduce-scatters and router gates and norms in float32, and torch.optim.AdamW, on one GPU.

    python3 bench/torch_moe_fsdp.py --config configs/moe-16x2.json --batch 8 --seq 1024 --steps 30

Prints one JSON line: tokens/s and the median step time over the steps after the warm-up.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fsdp"))
from torch_moe import MoETransformer  # noqa: E402  fsdpp's model in PyTorch, the same operations


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: Gloo on the CPU, for scripts/gpu-check.sh --dry-run (the plumbing only)")
    args = ap.parse_args()
    c = json.load(open(args.config))
    cuda = args.device == "cuda"
    # One process: an in-memory store, so no port is needed (a fixed one may be taken).
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model = MoETransformer(c).to(args.device)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Inputs keep their dtype: the norms compute in float32 and return it, the gate casts itself.
    f32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    # Router gates and norms in float32, as the fsdpp recipe's overrides; everything else bfloat16.
    for b in model.layers:
        for m in [b.attn_norm, b.ffn_norm] + ([b.moe.router] if hasattr(b, "moe") else []):
            fully_shard(m, mp_policy=f32)
        fully_shard(b, mp_policy=bf16)
    fully_shard(model.norm, mp_policy=f32)
    fully_shard(model, mp_policy=bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    times = []
    for s in range(args.steps):
        data = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(args.device)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        logits, aux = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        if aux is not None:
            loss = loss + aux
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    print(json.dumps({"impl": "pytorch fully_shard", "torch": torch.__version__, "config": args.config,
                      "batch": args.batch, "seq": args.seq, "step_ms_median": 1e3 * step,
                      "tokens_per_s": args.batch * args.seq / step, "last_loss": loss.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
