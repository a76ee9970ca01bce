"""How close a training run's tokens/s is to the machine's matrix-multiply speed.

    model_flops.py CONFIG SEQ_LEN [NAME=TOKENS_PER_S ...]

Counts the multiply-adds of one token's forward through the model of CONFIG (a configs/*.json
file) at sequence length SEQ_LEN: the attention projections, the dense layers' SwiGLU, the top-k
experts' SwiGLU of the MoE layers, the routers, the head, and causal attention's two products
(each query against (SEQ_LEN + 1) / 2 keys on average); a training step's are 3x that (backward
twice forward). Embedding lookups, norms and element-wise work count nothing: the figure is the
work that matrix-multiply kernels must do, so FLOP/s from it are a lower bound of what they ran.
Then times one-thread float32 matrix multiplies through PyTorch (torch.mm, 1024 x 1024 by 1024 x
1024, and the model's own shapes: [rows, dim] by [dim, out] for a microbatch of 16 sequences), the
best of several repeats: what one core reaches on this machine's kernels. Prints, for each
NAME=TOKENS_PER_S, the GFLOP/s that rate implies and what fraction of the cores' matrix-multiply
speed it is. Run it with libfsdpp.so preloaded on a non-Intel CPU so that MKL uses the same
kernels as fsdpp (bench/run_dp1_flops.sh does).
"""
import json
import sys
import time

import torch


def macs_per_token(c, seq_len):
    d, layers = c["dim"], c["layers"]
    dense = c.get("dense_layers", layers if not c.get("experts") else 0)
    moe = layers - dense if c.get("experts") else 0
    proj = layers * (d * 3 * d + d * d)
    ffn = dense * 3 * d * c["ffn_hidden"]
    experts = moe * c.get("top_k", 0) * 3 * d * c.get("expert_hidden", 0)
    router = moe * d * c.get("experts", 0)
    head = d * c["vocab_size"]
    attention = layers * 2 * d * (seq_len + 1) / 2
    return {"projections": proj, "dense SwiGLU": ffn, "experts (top-k)": experts, "routers": router,
            "head": head, "attention products": attention}


def mm_gflops(m, k, n, repeats=30):
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def main():
    config_path, seq_len = sys.argv[1], int(sys.argv[2])
    c = json.load(open(config_path))
    parts = macs_per_token(c, seq_len)
    fwd = sum(parts.values())
    step_flop_per_token = 3 * 2 * fwd
    torch.set_num_threads(1)
    rows = 16 * seq_len
    d = c["dim"]
    shapes = {"1024 x 1024 x 1024": (1024, 1024, 1024),
              f"qkv projection {rows} x {d} x {3 * d}": (rows, d, 3 * d),
              f"expert {rows // 2} x {d} x {c.get('expert_hidden', c['ffn_hidden'])}": (rows // 2, d, c.get("expert_hidden", c["ffn_hidden"]))}
    speeds = {name: mm_gflops(*s) for name, s in shapes.items()}
    core = max(speeds.values())
    print(f"model {config_path}, sequence length {seq_len}: forward multiply-adds per token "
          + ", ".join(f"{k} {v:,.0f}" for k, v in parts.items()) + f"; total {fwd:,.0f}")
    print(f"training FLOP per token (3 x forward, 2 FLOP per multiply-add): {step_flop_per_token / 1e6:.2f} M")
    for name, g in speeds.items():
        print(f"one thread, torch.mm {name}: {g:.1f} GFLOP/s")
    print(f"RESULT core_gflops={core:.1f} flop_per_token={step_flop_per_token:.0f}")
    for arg in sys.argv[3:]:
        name, rate = arg.split("=")
        g = float(rate) * step_flop_per_token / 1e9
        print(f"RUN {name} tokens_per_s={float(rate):.0f} gflops={g:.1f}")


if __name__ == "__main__":
    main()
