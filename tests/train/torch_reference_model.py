"""The fsdpp MoE model written again in PyTorch from the README's description ("Every detail
another implementation needs"), run on a consolidated file loaded with safetensors.torch.

Usage: torch_reference_model.py MODEL.safetensors CASE.safetensors
  MODEL  what `fsdpp ckpt consolidate` wrote (config in the metadata key fsdpp.model_config)
  CASE   "tokens" [B, T] int64 and fsdpp's "logits" [B, T, V] for them
Prints the largest difference; exits 1 when it exceeds 1e-4 of the logits' scale.
"""
import json
import math
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def rmsnorm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def swiglu(x, w1, w3, w2):
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def moe(W, p, c, h):
    D, k = c["dim"], c["top_k"]
    flat = h.reshape(-1, D)
    logits = (flat.to(W[p + "router.gate.weight"].dtype) @ W[p + "router.gate.weight"].T).float()
    scores = torch.sigmoid(logits) if c["score"] == "sigmoid" else logits.softmax(-1)
    weights, experts = scores.topk(k, -1)
    if c["normalize_top_k"] and (k > 1 or c["score"] == "sigmoid"):
        weights = weights / weights.sum(-1, keepdim=True)
    T, E = flat.shape[0], c["experts"]
    # Capacity: C slots per expert, taken in priority order (every token's first choice in token
    # order, then every second choice, ...); an assignment past C contributes nothing.
    kept = torch.ones(T, k, dtype=torch.bool)
    if c["routing"] == "capacity":
        C = math.ceil(c["capacity_factor"] * T * k / E)
        used = [0] * E
        for j in range(k):
            for t in range(T):
                e = int(experts[t, j])
                kept[t, j] = used[e] < C
                used[e] += 1
    out = torch.zeros_like(flat)
    for t in range(T):
        for j in range(k):
            if not kept[t, j]:
                continue
            e = int(experts[t, j])
            y = swiglu(flat[t:t + 1], W[p + "experts.w1"][e], W[p + "experts.w3"][e], W[p + "experts.w2"][e])
            out[t] += weights[t, j].to(flat.dtype) * y[0]
    if c.get("shared_expert"):
        out = out + swiglu(flat, W[p + "shared.w1.weight"], W[p + "shared.w3.weight"], W[p + "shared.w2.weight"])
    return out.view(h.shape)


def forward(W, c, tokens):
    B, T = tokens.shape
    D, H = c["dim"], c["heads"]
    hd = D // H
    inv_freq = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    x = W["embed.weight"][tokens]
    for i in range(c["layers"]):
        p = f"layers.{i}."
        h = rmsnorm(x, W[p + "attn_norm.weight"], c["norm_eps"])
        q, k, v = (h @ W[p + "attn.qkv.weight"].T).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hd)).masked_fill(causal, float("-inf")).float().softmax(-1)
        x = x + (att.to(v.dtype) @ v).transpose(1, 2).reshape(B, T, D) @ W[p + "attn.out.weight"].T
        h = rmsnorm(x, W[p + "ffn_norm.weight"], c["norm_eps"])
        if c["experts"] > 0 and i >= c["dense_layers"]:
            x = x + moe(W, p + "moe.", c, h)
        else:
            x = x + swiglu(h, W[p + "mlp.w1.weight"], W[p + "mlp.w3.weight"], W[p + "mlp.w2.weight"])
    return (rmsnorm(x, W["norm.weight"], c["norm_eps"]) @ W["head.weight"].T).float()


def main():
    model_file, case_file = sys.argv[1], sys.argv[2]
    with safe_open(model_file, "pt") as f:
        config = json.loads(f.metadata()["fsdpp.model_config"])
    weights = load_file(model_file)
    case = load_file(case_file)
    with torch.no_grad():
        logits = forward(weights, config, case["tokens"])
    want = case["logits"]
    diff = (logits - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"logits {tuple(logits.shape)}: largest difference {diff:.3g} (largest logit {scale:.3g})")
    return 0 if logits.shape == want.shape and diff <= 1e-4 * scale else 1


if __name__ == "__main__":
    sys.exit(main())
