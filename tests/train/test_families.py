"""The transformers families besides Llama and Mixtral, checked by transformers itself.

    python test_families.py FSDPP_BIN PROBE_BIN

No downloads: for each family a random model is made by transformers' own class from the family's
published config, scaled down: Llama 3.1's rope scaling ("llama3") and linear rope scaling,
Mistral's sliding window and wide heads, Qwen2's query/key/value biases, Qwen3's q/k norms and
heads wider than hidden / heads; Qwen3-MoE (its norms, fine-grained experts renormalised, a
dense layer by mlp_only_layers), Qwen2-MoE (a shared expert behind a sigmoid gate, every second layer
MoE by decoder_sparse_step) and OLMoE (norms over the whole projection, weights not renormalised). For each:
(1) fsdpp's logits within 1e-5 of transformers' (float32), over more positions than the sliding
    window and the rope's original context; transformers' own model without the feature differs by
    far more (so the check can fail);
(2) 48 greedy tokens of `fsdpp generate` (KV cache) identical to transformers' generate;
(3) import then `export --format hf`: the same class and the same tensors bit for bit;
(4) one training step from the checkpoint at dp 1, dp 2 and pp 2 (and experts over ep 2): the same
    first loss.
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from harness import Harness, first_loss, randomize, tensors_of
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

FSDPP, PROBE = sys.argv[1:3]
H = Harness("fsdpp-families-")
WORK, failures, check, run, path = H.work, H.failures, H.check, H.run, H.path

common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=None, tie_word_embeddings=False)
# Each family: its class, its config, and the same config without the feature (None: the feature is
# in the weights, removed by zeroing `strip`).
families = {
    "llama-rope-llama3": (LlamaForCausalLM, LlamaConfig(**common, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "llama-rope-linear": (LlamaForCausalLM, LlamaConfig(**common, rope_parameters={
        "rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "mistral": (MistralForCausalLM, MistralConfig(**common, sliding_window=12, head_dim=24), {"sliding_window": None}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common), "bias"),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=32), "norm"),
    # Fine-grained experts renormalised, a dense first layer; OLMoE's norms over the whole projection,
    # its top-k weights as the softmax gave them.
    "qwen3-moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=40, norm_topk_prob=True,
                                                      mlp_only_layers=[0]), "norm"),
    # A gated shared expert beside the routed ones, every second layer MoE, biases.
    "qwen2-moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                      norm_topk_prob=False, decoder_sparse_step=2), "bias"),
    "olmoe": (OlmoeForCausalLM, OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
              "norm"),
}


torch.manual_seed(0)
tokens = torch.randint(0, 256, (2, 60))
for name, (cls, config, without) in families.items():
    torch.manual_seed(1)
    model = cls(config)
    randomize(model, std=0.1, norm_spread=0.3)
    model.eval()
    d = path("hf", name)
    model.save_pretrained(d)
    # (1) logits, and what transformers computes without the feature.
    with torch.no_grad():
        theirs = model(tokens).logits.float()
        if isinstance(without, dict):
            plain = cls(type(config)(**dict(config.to_dict(), **without)))
            plain.load_state_dict(model.state_dict())
        else:
            plain = cls(config)
            plain.load_state_dict(model.state_dict())
            for n, p in plain.named_parameters():
                if (without == "bias" and n.endswith("_proj.bias")) or (without == "norm" and "_norm." in n and
                                                                        "self_attn" in n):
                    p.fill_(0.0 if without == "bias" else 1.0)
        apart = (plain.eval()(tokens).logits.float() - theirs).abs().max().item()
    diff = (H.probe_logits(PROBE, d, tokens) - theirs).abs().max().item()
    check(diff <= 1e-5 and apart > 1e-3,
          f"{name}: fsdpp's logits within 1e-5 of transformers' ({diff:.2e}; without the feature {apart:.2e})")
    # (2) greedy generation, bytes in and out.
    prompt = "The cat "
    out = subprocess.run([FSDPP, "generate", d, "--tokenizer", "bytes", "--prompt", prompt, "--temperature", "0",
                          "--max-new-tokens", "48"],
                         capture_output=True, check=True).stdout
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)[0, ids.shape[1]:]
    check(list(out[len(prompt):-1]) == want.tolist(), f"{name}: 48 greedy tokens identical to transformers'")
    # (3) import, export: the same class and tensors.
    file = path(f"{name}.safetensors")
    run(FSDPP, "import", d, "-o", file)
    back = path("back", name)
    run(FSDPP, "export", file, "-o", back)
    a, b = tensors_of(d), tensors_of(back)
    same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    again = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    check(same and type(again) is cls, f"{name}: import then export gives {type(again).__name__} and the same "
                                       f"{len(a)} tensors bit for bit")
    # (4) one step at dp 1, dp 2 and pp 2.
    losses = {}
    layouts = [("dp1", {}), ("dp2", {"dp": 2}), ("pp2", {"pp": 2, "microbatches": 2})]
    if name.endswith("moe"):
        layouts.append(("ep2", {"dp": 2, "ep": 2}))
    for layout, parallel in layouts:
        recipe = {"model": {"init_from": d},
                  "data": {"source": "synthetic", "seq_len": 48, "synthetic_bytes": 100000},
                  "parallel": {"dp": 1, "pp": 1, **parallel},
                  "optim": {"lr": 1e-2, "warmup_steps": 1},
                  "train": {"steps": 1, "global_batch": 4}, "eval": {"interval": 1, "batches": 1},
                  "checkpoint": {"interval": 1},
                  "logging": {"interval": 1, "output_dir": path("runs", f"{name}-{layout}")}}
        file = path(f"{name}-{layout}.json")
        json.dump(recipe, open(file, "w"))
        run(FSDPP, "run", file)
        losses[layout] = first_loss(path("runs", f"{name}-{layout}"))
    check(max(losses.values()) - min(losses.values()) <= 1e-4 * max(losses.values()),
          f"{name}: the same first loss at {losses}")

print(f"{len(failures)} failure(s)")
shutil.rmtree(WORK, ignore_errors=True)
sys.exit(1 if failures else 0)
