"""transformers' side of bench/generate_bench.cpp: LlamaForCausalLM of the same shape, random weights,
greedy generate with and without its cache (use_cache), the same RESULT line.
  generate_peer.py --prompt L --cache 0|1 [--dim 256 --layers 4 --heads 8 --kv-heads 2 --ffn 704 --new 32]
"""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
for name, default in [("dim", 256), ("layers", 4), ("heads", 8), ("kv-heads", 2), ("ffn", 704), ("new", 32),
                      ("cache", 1), ("prompt", 16)]:
    ap.add_argument(f"--{name}", type=int, default=default)
a = ap.parse_args()
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=a.dim, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                  max_position_embeddings=a.prompt + a.new + 1, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(97, 123, (1, a.prompt))


def timed(n):  # the fastest of 3 calls, as on fsdpp's side
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=bool(a.cache))
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


timed(1)
first = timed(1)
total = timed(a.new + 1)
print(f"RESULT generate prompt={a.prompt} cache={a.cache} first_ms={first:.3f} "
      f"per_token_ms={(total - first) / a.new:.4f}")
