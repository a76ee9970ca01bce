"""PyTorch DDP baseline for bench/fsdp_bench.cpp: the same transformer, batch and optimizer, in
Python over Gloo. Run under a torchrun-compatible launcher:
    fsdpp launch --nproc 2 -- python3 bench/ddp_baseline.py [--steps 20] [--batch 16]
"""
import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, -1e9).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab=256, dim=128, heads=4, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = 64
    g = torch.Generator().manual_seed(1)
    data = torch.randint(256, (args.batch, seq + 1), generator=g)
    local = args.batch // world
    data = data[rank * local:(rank + 1) * local]
    x, y = data[:, :seq], data[:, 1:]
    model = nn.parallel.DistributedDataParallel(Transformer())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()

    for _ in range(3):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    secs = time.perf_counter() - t0
    if rank == 0:
        print(f"RESULT throughput pytorch-ddp dp={world} threads/rank=1 "
              f"tokens/s={args.batch * seq * args.steps / secs:.0f} step_ms={secs / args.steps * 1e3:.1f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
