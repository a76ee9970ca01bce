"""fsdpp's MoE transformer (include/fsdpp/models/moe.hpp, src/models/moe.cpp) as a PyTorch nn.Module,
with the same parameter names and the same operations in the same order, so that PyTorch's own
FSDP2 can train it side by side with fsdpp's fully_shard (tests/fsdp/test_torch_fsdp.py) and
benchmarks can run the same work in PyTorch (bench/torch_peer.py, bench/torch_moe_fsdp.py).

    model = MoETransformer(config)     # config: the JSON of configs/*.json, defaults filled in
    logits, aux = model(tokens)        # aux: the sum of every MoE layer's weighted auxiliary losses

With attach_aux(model, scale) each MoE layer instead attaches its auxiliary losses to its output,
as fsdpp's model does (an identity whose backward gives them the gradient `scale`), and forward
returns the logits alone: what a pipeline stage needs, where no single loss sees every layer.
"""
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = {
    "vocab_size": 256, "dim": 128, "layers": 4, "heads": 4, "max_seq_len": 256, "ffn_hidden": 384,
    "dense_layers": 0, "experts": 4, "top_k": 2, "expert_hidden": 192, "shared_expert": False,
    "score": "softmax", "normalize_top_k": True, "routing": "dropless", "capacity_factor": 1.25,
    "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "rope_theta": 10000.0, "norm_eps": 1e-5, "init_std": 0.02,
}


def full_config(c):
    return {**DEFAULTS, **c}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.theta = c["heads"], c["rope_theta"]
        self.qkv = nn.Linear(c["dim"], 3 * c["dim"], bias=False)
        self.out = nn.Linear(c["dim"], c["dim"], bias=False)

    def rope_tables(self, T, hd, like):
        """cos and sin of the rotary angles of T positions, kept between calls as fsdpp's model does."""
        key = (T, hd, like.dtype, like.device)
        if getattr(self, "_rope_key", None) != key:
            with torch.no_grad():
                f = dict(dtype=torch.float32, device=like.device)
                inv_freq = 1.0 / torch.pow(self.theta, torch.arange(0, hd, 2, **f) / hd)
                angles = torch.outer(torch.arange(T, **f), inv_freq)
                cos = torch.cat((angles.cos(), angles.cos()), -1).to(like.dtype)
                sin = torch.cat((angles.sin(), angles.sin()), -1).to(like.dtype)
            self._rope_key, self._rope = key, (cos, sin)
        return self._rope

    def forward(self, x):
        B, T, D = x.shape
        hd = D // self.heads
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.rope_tables(T, hd, x)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


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
        self.w1 = nn.Parameter(torch.empty(E, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(E, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(E, dim, hidden))

    def forward_one(self, e, x):
        h = F.silu(torch.matmul(x, self.w1[e].t())) * torch.matmul(x, self.w3[e].t())
        return torch.matmul(h, self.w2[e].t())


class Router(nn.Module):
    def __init__(self, dim, E):
        super().__init__()
        self.gate = nn.Linear(dim, E, bias=False)

    def forward(self, flat):
        # The gate's product in its own dtype, scores in float32. A forward of its own, so that a
        # router wrapped by fully_shard on its own (bench/torch_moe_fsdp.py) is gathered for it.
        gw = self.gate.weight
        return torch.matmul(flat.to(gw.dtype), gw.t()).float()


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        if c["routing"] not in ("dropless", "capacity"):
            raise ValueError(f"torch_moe: unknown routing {c['routing']!r}")
        self.c = c
        self.router = Router(c["dim"], c["experts"])
        self.experts = Experts(c["experts"], c["dim"], c["expert_hidden"])
        self.shared = SwiGLU(c["dim"], c["expert_hidden"]) if c["shared_expert"] else None

    def forward(self, x):
        c = self.c
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        T, k, E = flat.shape[0], c["top_k"], c["experts"]
        logits = self.router(flat)
        scores = torch.sigmoid(logits) if c["score"] == "sigmoid" else torch.softmax(logits, -1)
        w, idx = torch.topk(scores, k, -1)
        if c["normalize_top_k"] and (k > 1 or c["score"] == "sigmoid"):
            w = w / w.sum(-1, keepdim=True)
        flat_idx = idx.reshape(-1)
        ones = torch.ones(flat_idx.shape, dtype=scores.dtype, device=x.device)
        counts = torch.zeros(E, dtype=scores.dtype, device=x.device).scatter_add_(0, flat_idx, ones)
        probs = scores / scores.sum(-1, keepdim=True) if c["score"] == "sigmoid" else scores
        aux_loss = E * ((counts / (T * k)) * probs.mean(0)).sum()
        z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        weights = w.to(x.dtype)
        if c["routing"] == "capacity":
            out = self.capacity(flat, idx, weights)
        else:
            out = self.dropless(flat, idx, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape), c["aux_loss_coef"] * aux_loss + c["z_loss_coef"] * z_loss

    def capacity(self, flat, idx, weights):
        """C slots per expert taken in priority order (every token's first choice, then the second
        ...); assignments past capacity go to a spare row whose output is zero."""
        T, k, E = flat.shape[0], self.c["top_k"], self.c["experts"]
        C = math.ceil(self.c["capacity_factor"] * T * k / E)
        e_flat = idx.t().reshape(-1)
        w_flat = weights.t().reshape(-1)
        one_hot = torch.zeros(k * T, E, dtype=e_flat.dtype, device=flat.device).scatter_(1, e_flat.unsqueeze(1), 1)
        pos = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
        keep = pos < C
        slots = torch.where(keep, e_flat * C + pos, torch.full_like(pos, E * C))
        buf = torch.zeros(E * C + 1, flat.shape[1], dtype=flat.dtype, device=flat.device).index_copy(0, slots, flat.repeat(k, 1))
        x = buf[: E * C].view(E, C, -1)
        ex = self.experts
        h = F.silu(torch.bmm(x, ex.w1.transpose(1, 2))) * torch.bmm(x, ex.w3.transpose(1, 2))
        y = torch.bmm(h, ex.w2.transpose(1, 2)).reshape(E * C, -1)
        y = torch.cat((y, torch.zeros(1, y.shape[1], dtype=y.dtype, device=y.device)))
        return (y.index_select(0, slots) * (w_flat * keep.to(w_flat.dtype)).unsqueeze(1)).view(k, T, -1).sum(0)

    def dropless(self, flat, idx, weights):
        """Each expert on exactly the rows routed to it: on the CPU one grouped matmul per weight,
        elsewhere one expert after another."""
        T, k, E = flat.shape[0], self.c["top_k"], self.c["experts"]
        out = torch.zeros_like(flat)
        if flat.is_cpu:
            e_flat = idx.reshape(-1)
            order = torch.sort(e_flat, stable=True).indices
            counts = torch.zeros(E, dtype=e_flat.dtype).scatter_add_(0, e_flat, torch.ones_like(e_flat))
            offsets = counts.cumsum(0).to(torch.int32)
            tok = torch.floor_divide(order, k)
            xs = flat.index_select(0, tok)
            ex = self.experts
            h = F.silu(torch._grouped_mm(xs, ex.w1.transpose(1, 2), offs=offsets)) * \
                torch._grouped_mm(xs, ex.w3.transpose(1, 2), offs=offsets)
            y = torch._grouped_mm(h, ex.w2.transpose(1, 2), offs=offsets) * weights.reshape(-1).index_select(0, order).unsqueeze(1)
            return out.index_add(0, tok, y)
        e_flat = idx.reshape(-1)
        tok = torch.arange(T, device=flat.device).repeat_interleave(k)
        w_flat = weights.reshape(-1)
        order = torch.sort(e_flat, stable=True).indices
        n = torch.bincount(e_flat, minlength=E).tolist()
        offset = 0
        for e in range(E):
            if n[e] == 0:
                continue
            rows = order[offset:offset + n[e]]
            offset += n[e]
            t = tok.index_select(0, rows)
            y = self.experts.forward_one(e, flat.index_select(0, t)) * w_flat.index_select(0, rows).unsqueeze(1)
            out = out.index_add(0, t, y)
        return out


class AttachAux(torch.autograd.Function):
    """Identity on x whose backward also gives `aux` the gradient `scale`."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def attach_aux(model, scale):
    """Every block attaches its auxiliary losses to its output with gradient `scale` (for example
    1 / microbatches); the model's forward then returns the logits alone."""
    model.aux_scale = scale
    for block in model.layers:
        block.aux_scale = scale


class Block(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.attn_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c["dim"], c["norm_eps"])
        if c["experts"] > 0 and i >= c["dense_layers"]:
            self.moe = MoE(c)
        else:
            self.mlp = SwiGLU(c["dim"], c["ffn_hidden"])

    aux_scale = None

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        if hasattr(self, "moe"):
            y, aux = self.moe(h)
            if self.aux_scale is not None:
                return AttachAux.apply(x + y, aux, self.aux_scale) if torch.is_grad_enabled() else x + y
            return x + y, aux
        return x + self.mlp(h) if self.aux_scale is not None else (x + self.mlp(h), None)


class MoETransformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        c = full_config(c)
        self.config = c
        self.embed = nn.Embedding(c["vocab_size"], c["dim"])
        self.layers = nn.ModuleList(Block(c, i) for i in range(c["layers"]))
        self.norm = RMSNorm(c["dim"], c["norm_eps"])
        self.head = nn.Linear(c["dim"], c["vocab_size"], bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """fsdpp's initialisation: normal(0, init_std), output projections init_std / sqrt(2 layers)."""
        std = self.config["init_std"]
        out_std = std / math.sqrt(2.0 * self.config["layers"])
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, out_std if name.endswith(("out.weight", "w2.weight", "experts.w2")) else std)

    aux_scale = None

    def forward(self, tokens):
        h, aux = self.embed(tokens), None
        for block in self.layers:
            if self.aux_scale is not None:
                h = block(h)
                continue
            h, a = block(h)
            if a is not None:
                aux = a if aux is None else aux + a
        logits = self.head(self.norm(h)).float()
        return logits if self.aux_scale is not None else (logits, aux)


def lm_loss(logits, targets):
    """Mean next-token cross entropy, as fsdpp's models::lm_loss."""
    V = logits.shape[-1]
    return F.nll_loss(torch.log_softmax(logits.reshape(-1, V).float(), -1), targets.reshape(-1))


def exit_rank(code=0):
    """Ends a rank's process without Python's interpreter finalization, once its process group is
    destroyed and its results written. At finalization PyTorch's Gloo threads can still hold work
    whose tensors need the GIL, and the process aborts ("terminate called without an active
    exception"; pytorch/pytorch#179291): seen twice in about forty runs of the FSDP2 comparison."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
