"""Writes what recipes/finetune-chat.json starts from, as a published chat model comes:
recipes/hf/llama-chat-tiny (a tiny random LlamaForCausalLM saved by transformers' save_pretrained,
with a byte-level BPE tokenizer trained here by Hugging Face tokenizers on the fortunes, ChatML's
special tokens and chat template, saved by PreTrainedTokenizerFast) and recipes/data/chat-fortunes.jsonl
(conversations made from the fortunes: a user asks, the assistant answers with a fortune).
Run from the repository root with the project's Python:

    python recipes/hf/make_chat_tiny.py
"""
import json
import os
import random
import shutil

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "llama-chat-tiny")
DATA = os.path.join(HERE, "..", "data", "chat-fortunes.jsonl")
FORTUNES = "/usr/share/games/fortunes"
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant who answers in fortunes.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def fortunes():
    out = []
    for name in sorted(os.listdir(FORTUNES)):
        path = os.path.join(FORTUNES, name)
        if "." in name or not os.path.isfile(path) or os.path.islink(path):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        out += [f.strip() for f in text.split("\n%\n") if 20 <= len(f.strip()) <= 200]
    return out


def main():
    texts = fortunes()
    rng = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=768, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    shutil.rmtree(OUT, ignore_errors=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(OUT)
    fast.save_pretrained(OUT)

    asks = ["Tell me a fortune.", "Say something wise.", "Give me a quote, please.", "What does the future hold?",
            "Cheer me up.", "Any advice for today?"]
    picked = rng.sample(texts, 600)
    with open(DATA, "w", encoding="utf-8") as f:
        for i, text in enumerate(picked):
            if i % 5 == 4:  # prompt and completion, as TRL's datasets have them
                f.write(json.dumps({"prompt": rng.choice(asks), "completion": text}) + "\n")
            elif i % 7 == 6:  # two turns
                other = rng.choice(texts)
                f.write(json.dumps({"messages": [
                    {"role": "user", "content": rng.choice(asks)}, {"role": "assistant", "content": other},
                    {"role": "user", "content": "Another one."}, {"role": "assistant", "content": text}]}) + "\n")
            else:
                f.write(json.dumps({"messages": [{"role": "user", "content": rng.choice(asks)},
                                                 {"role": "assistant", "content": text}]}) + "\n")


if __name__ == "__main__":
    main()
