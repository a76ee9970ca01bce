"""Writes recipes/hf/mixtral-tiny: a tiny random MixtralForCausalLM saved by transformers'
save_pretrained (what recipes/finetune-hf.json starts from), with the bytes tokenizer as
`fsdpp export` writes it. Run from the repository root with the project's Python:

    python recipes/hf/make_mixtral_tiny.py build/fsdpp
"""
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from transformers import MixtralConfig, MixtralForCausalLM

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixtral-tiny")
torch.manual_seed(0)
config = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=None, sliding_window=None)
shutil.rmtree(out, ignore_errors=True)
MixtralForCausalLM(config).save_pretrained(out)
# The bytes tokenizer's files, from an export of any model with the bytes tokenizer.
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model.safetensors")
    subprocess.run([sys.argv[1], "import", out, "-o", model], check=True, capture_output=True)
    subprocess.run([sys.argv[1], "export", model, "-o", os.path.join(tmp, "export")], check=True, capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tmp, "export", name), os.path.join(out, name))
print("wrote", out, sorted(os.listdir(out)))
