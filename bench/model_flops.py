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
best of several repeats: what one core reaches on this machine's kernels. Then times the model's own
weight products for one microbatch of 16 sequences, each layer's forward and both its gradients
(x W^T, dY W, dY^T x) at its own shape, the experts' each on its share of the routed rows (rows x
top_k / experts), the median of several repeats: what one core spends on them before anything else
runs; and again with the caches cleared (64 MB written) before each call, as a training step
meets operands written long before. With attention's two products counted at the best speed, that
gives the most tokens/s that one thread per core can reach on these kernels, every other operation
free. Prints, for each
NAME=TOKENS_PER_S, the GFLOP/s that rate implies and what fraction of the cores' matrix-multiply
speed it is. Run it with libfsdpp_mkl_kernels.so preloaded on a non-Intel CPU so that MKL uses the same
kernels as fsdpp (bench/run_dp1_flops.sh does).
"""
import json
import sys
import time

import torch


def layer_kinds(c):
    """(dense, moe): how many layers have a dense SwiGLU and how many an MoE layer."""
    layers = c["layers"]
    dense = c.get("dense_layers", layers if not c.get("experts") else 0)
    return dense, layers - dense if c.get("experts") else 0


def macs_per_token(c, seq_len):
    d, layers = c["dim"], c["layers"]
    dense, moe = layer_kinds(c)
    proj = layers * (d * 3 * d + d * d)
    ffn = dense * 3 * d * c["ffn_hidden"]
    experts = moe * c.get("top_k", 0) * 3 * d * c.get("expert_hidden", 0)
    router = moe * d * c.get("experts", 0)
    head = d * c["vocab_size"]
    attention = layers * 2 * d * (seq_len + 1) / 2
    return {"projections": proj, "dense SwiGLU": ffn, "experts (top-k)": experts, "routers": router,
            "head": head, "attention products": attention}


def weight_products(c, rows):
    """(name, rows, in, out, count): the weight products of one microbatch of `rows` tokens."""
    d, layers = c["dim"], c["layers"]
    dense, moe = layer_kinds(c)
    out = [("qkv projection", rows, d, 3 * d, layers), ("output projection", rows, d, d, layers)]
    if dense:
        h = c["ffn_hidden"]
        out += [("dense w1, w3", rows, d, h, 2 * dense), ("dense w2", rows, h, d, dense)]
    if moe:
        e, h = c["experts"], c["expert_hidden"]
        share = rows * c["top_k"] // e
        out += [("expert w1, w3", share, d, h, 2 * e * moe), ("expert w2", share, h, d, e * moe),
                ("router", rows, d, e, moe)]
    return out + [("head", rows, d, c["vocab_size"], 1)]


def call_times(f, repeats, before=None):
    """Seconds of each of `repeats` calls of f after 3 untimed ones, `before` run ahead of each."""
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return times


def median_ms(f, repeats=15, before=None):
    times = sorted(call_times(f, repeats, before))
    return times[len(times) // 2] * 1e3


def product_ms(m, k, n, before=None):
    """Forward, input gradient and weight gradient of x W^T for x [m, k], W [n, k]: ms each, `before`
    run ahead of each timed call."""
    x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    return (median_ms(lambda: torch.mm(x, w.t()), before=before), median_ms(lambda: torch.mm(dy, w), before=before),
            median_ms(lambda: torch.mm(dy.t(), x), before=before))


def mm_gflops(m, k, n, repeats=30):
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / min(call_times(lambda: torch.mm(a, b), repeats)) / 1e9


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
    products = weight_products(c, rows)
    weight_macs = sum(m * k * n * count for _, m, k, n, count in products)
    assert abs(weight_macs - rows * (fwd - parts["attention products"])) < 1, "weight products miscounted"
    # In a training step a product's operands were mostly written long before (the saved
    # activations, the gradient of the layer above): timed again with the caches cleared first.
    junk = torch.empty(64 << 20, dtype=torch.uint8)
    total_ms = cold_ms = 0.0
    for name, m, k, n, count in products:
        f, dx, dw = product_ms(m, k, n)
        cold = sum(product_ms(m, k, n, before=lambda: junk.fill_(1)))
        total_ms += count * (f + dx + dw)
        cold_ms += count * cold
        print(f"one thread, {name} [{m} x {k}] by [{k} x {n}], x{count} a microbatch: forward {f:.3f} ms, "
              f"input gradient {dx:.3f} ms, weight gradient {dw:.3f} ms ({6 * m * k * n / (f + dx + dw) / 1e6:.0f} GFLOP/s); "
              f"all three {cold:.3f} ms with the caches cleared before each")
    attention_ms = 6 * rows * parts["attention products"] / (core * 1e6)
    bound = rows / ((total_ms + attention_ms) / 1e3)
    print(f"one microbatch of {rows} tokens: weight products {total_ms:.1f} ms "
          f"({6 * weight_macs / total_ms / 1e6:.0f} GFLOP/s; {cold_ms:.1f} ms with the caches cleared before each, "
          f"{cold_ms / total_ms:.2f}x), attention's products {attention_ms:.1f} ms at "
          f"{core:.0f} GFLOP/s: at most {bound:,.0f} tokens/s a core with everything else free")
    print(f"RESULT core_gflops={core:.1f} flop_per_token={step_flop_per_token:.0f} products_bound_per_core={bound:.0f}")
    for arg in sys.argv[3:]:
        name, rate = arg.split("=")
        g = float(rate) * step_flop_per_token / 1e9
        print(f"RUN {name} tokens_per_s={float(rate):.0f} gflops={g:.1f}")


if __name__ == "__main__":
    main()
