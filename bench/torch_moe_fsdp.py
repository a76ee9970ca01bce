#!/usr/bin/env python3
"""The reference for fsdpp's GPU figures: the same MoE transformer as include/models/moe.hpp
(capacity routing, the same layers and math, explicit float32 attention softmax), trained with
PyTorch's own FSDP2 `fully_shard` (each block, then the root), bfloat16 compute with float32
reduce-scatters and router gates and norms in float32, and torch.optim.AdamW, on one GPU.

    python3 bench/torch_moe_fsdp.py --config configs/moe-16x2.json --batch 8 --seq 1024 --steps 30

Prints one JSON line: tokens/s and the median step time over the steps after the warm-up.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.theta = c["heads"], c.get("rope_theta", 10000.0)
        self.qkv = nn.Linear(c["dim"], 3 * c["dim"], bias=False)
        self.out = nn.Linear(c["dim"], c["dim"], bias=False)

    def forward(self, x):
        B, T, D = x.shape
        hd = D // self.heads
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        f = dict(dtype=torch.float32, device=x.device)
        inv = self.theta ** (-torch.arange(0, hd, 2, **f) / hd)
        ang = torch.outer(torch.arange(T, **f), inv)
        cos = torch.cat((ang.cos(), ang.cos()), -1).to(x.dtype)
        sin = torch.cat((ang.sin(), ang.sin()), -1).to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(mask, float("-inf")).float(), -1).to(x.dtype)
        return self.out((att @ v).transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    def __init__(self, E, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, hidden, dim) * 0.02)
        self.w3 = nn.Parameter(torch.randn(E, hidden, dim) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, dim, hidden) * 0.02)

    def forward(self, x):  # [E, C, dim]
        h = F.silu(x @ self.w1.transpose(1, 2)) * (x @ self.w3.transpose(1, 2))
        return h @ self.w2.transpose(1, 2)


class Gate(nn.Module):
    def __init__(self, dim, E):
        super().__init__()
        self.gate = nn.Linear(dim, E, bias=False)

    def forward(self, x):  # in the gate's own dtype (float32), as fsdpp's router
        w = self.gate.weight
        return (x.to(w.dtype) @ w.t()).float()


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.router = Gate(c["dim"], c["experts"])
        self.experts = Experts(c["experts"], c["dim"], c["expert_hidden"])
        self.shared = SwiGLU(c["dim"], c["expert_hidden"]) if c.get("shared_expert") else None

    def forward(self, x):
        c, shape = self.c, x.shape
        flat = x.reshape(-1, shape[-1])
        T, k, E = flat.shape[0], c["top_k"], c["experts"]
        logits = self.router(flat)
        scores = torch.softmax(logits, -1)
        w, idx = torch.topk(scores, k, -1)
        w = w / w.sum(-1, keepdim=True)
        counts = torch.zeros(E, device=x.device).scatter_add_(0, idx.reshape(-1), torch.ones(T * k, device=x.device))
        aux = E * ((counts / (T * k)) * scores.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        C = math.ceil(c.get("capacity_factor", 1.25) * T * k / E)
        e_flat = idx.t().reshape(-1)
        w_flat = w.to(x.dtype).t().reshape(-1)
        one_hot = torch.zeros(k * T, E, dtype=e_flat.dtype, device=x.device).scatter_(1, e_flat.unsqueeze(1), 1)
        pos = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
        keep = pos < C
        slots = torch.where(keep, e_flat * C + pos, torch.full_like(pos, E * C))
        buf = torch.zeros(E * C + 1, flat.shape[1], dtype=flat.dtype, device=x.device).index_copy(0, slots, flat.repeat(k, 1))
        y = self.experts(buf[: E * C].view(E, C, -1)).reshape(E * C, -1)
        y = torch.cat((y, torch.zeros(1, y.shape[1], dtype=y.dtype, device=y.device)))
        out = (y.index_select(0, slots) * (w_flat * keep.to(w_flat.dtype)).unsqueeze(1)).view(k, T, -1).sum(0)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape), c["aux_loss_coef"] * aux + c["z_loss_coef"] * z


class Block(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(c["dim"], 1e-5), RMSNorm(c["dim"], 1e-5)
        self.attn = Attention(c)
        is_moe = c["experts"] > 0 and i >= c.get("dense_layers", 0)
        self.moe = MoE(c) if is_moe else None
        self.mlp = None if is_moe else SwiGLU(c["dim"], c["ffn_hidden"])

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        if self.moe is None:
            return x + self.mlp(h), x.new_zeros((), dtype=torch.float32)
        y, aux = self.moe(h)
        return x + y, aux


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c["vocab_size"], c["dim"])
        self.layers = nn.ModuleList([Block(c, i) for i in range(c["layers"])])
        self.norm = RMSNorm(c["dim"], 1e-5)
        self.head = nn.Linear(c["dim"], c["vocab_size"], bias=False)

    def forward(self, tokens):
        h, aux = self.embed(tokens), 0.0
        for b in self.layers:
            h, a = b(h)
            aux = aux + a
        return self.head(self.norm(h)).float(), aux


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    c = json.load(open(args.config))
    # One process: an in-memory store, so no port is needed (a fixed one may be taken).
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = Model(c).cuda()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Inputs keep their dtype: the norms compute in float32 and return it, the gate casts itself.
    f32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    # Router gates and norms in float32, as the fsdpp recipe's overrides; everything else bfloat16.
    for b in model.layers:
        for m in [b.attn_norm, b.ffn_norm] + ([b.moe.router] if b.moe is not None else []):
            fully_shard(m, mp_policy=f32)
        fully_shard(b, mp_policy=bf16)
    fully_shard(model.norm, mp_policy=f32)
    fully_shard(model, mp_policy=bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    times = []
    for s in range(args.steps):
        data = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        logits, aux = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1)) + aux
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    print(json.dumps({"impl": "pytorch fully_shard", "torch": torch.__version__, "config": args.config,
                      "batch": args.batch, "seq": args.seq, "step_ms_median": 1e3 * step,
                      "tokens_per_s": args.batch * args.seq / step, "last_loss": loss.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
