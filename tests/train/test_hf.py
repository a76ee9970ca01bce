"""Hugging Face transformers checkpoints in and out of fsdpp, checked by transformers itself.

    python test_hf.py FSDPP_BIN PROBE_BIN SOURCE_DIR

No downloads: the transformers models are made here, at random, with transformers' own classes.
(1) export: fsdpp models trained a few steps (dense and MoE, grouped-query attention, tied
    embeddings), exported, loaded by AutoModelForCausalLM: logits within 1e-5 of fsdpp's, 64 greedy
    tokens identical to `fsdpp generate`'s, the tokenizer's ids equal to fsdpp's;
(2) import: random LlamaForCausalLM and MixtralForCausalLM saved by save_pretrained, read by fsdpp:
    logits within 1e-5 of transformers'; one training step from them at dp 1, dp 2, pp 2 and (the
    Mixtral) experts over ep 2, each rank reading its shards' rows, with the same first loss;
(3) round trip: import then export gives the original tensors bit for bit;
(4) bad input: clear errors, nothing written;
(5) a published model's tokenizer.json: init_from takes it, ids equal AutoTokenizer's, export keeps
    it byte for byte, greedy generation equal to transformers'.
"""

import json
import os
import shutil
import subprocess
import sys

import torch
from harness import Harness, first_loss, randomize, tensors_of
from safetensors.torch import load_file, save_file

import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                          MixtralForCausalLM)

FSDPP, PROBE, SOURCE = sys.argv[1:4]
H = Harness("fsdpp-hf-")
WORK, failures, check, run, path = H.work, H.failures, H.check, H.run, H.path


def fsdpp_logits(model_path, tokens):
    return H.probe_logits(PROBE, model_path, tokens)


def hf_logits(model_dir, tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float(), model


def max_diff(a, b):
    return (a - b).abs().max().item()


def write_recipe(name, model, **sections):
    recipe = {
        "model": model,
        "data": {"source": "synthetic", "seq_len": 32, "synthetic_bytes": 100000},
        "parallel": {"dp": 1, "pp": 1},
        "optim": {"lr": 1e-2, "warmup_steps": 1},
        "train": {"steps": 3, "global_batch": 4},
        "eval": {"interval": 3, "batches": 1},
        "checkpoint": {"interval": 3},
        "logging": {"interval": 1, "output_dir": path("runs", name)},
    }
    for key, value in sections.items():
        recipe[key].update(value)
    file = path(f"{name}.json")
    with open(file, "w") as f:
        json.dump(recipe, f)
    return file




torch.manual_seed(0)
tokens = torch.randint(0, 256, (2, 24))

# ---------------------------------------------------------------- (1) export
dense = {"vocab_size": 256, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "max_seq_len": 128,
         "ffn_hidden": 96, "experts": 0, "tie_embeddings": True}
moe = {"vocab_size": 256, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "max_seq_len": 128,
       "experts": 4, "top_k": 2, "expert_hidden": 48, "score": "softmax", "routing": "dropless"}
moe_mha = dict(moe, kv_heads=0, heads=2)
for name, model in [("dense-gqa-tied", dense), ("moe-gqa", moe), ("moe-mha", moe_mha)]:
    run(FSDPP, "run", write_recipe(name, model))
    run_dir = path("runs", name)
    exported = path("export", name)
    out = run(FSDPP, "export", run_dir, "-o", exported, "--format", "hf").stdout
    config = json.load(open(os.path.join(exported, "config.json")))
    arch = "MixtralForCausalLM" if model["experts"] else "LlamaForCausalLM"
    check(config["architectures"] == [arch], f"export {name}: config.json names {arch}")
    ours = fsdpp_logits(run_dir, tokens)
    theirs, hf_model = hf_logits(exported, tokens)
    check(type(hf_model).__name__ == arch, f"export {name}: transformers builds {type(hf_model).__name__}")
    d = max_diff(ours, theirs)
    check(d <= 1e-5 and ours.abs().max().item() > 0.1, f"export {name}: logits within 1e-5 of fsdpp's ({d:.2e})")
    if model.get("tie_embeddings"):
        check(hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr(),
              f"export {name}: transformers ties lm_head to the embedding")
    # 64 greedy tokens: fsdpp generate against transformers' generate.
    prompt = "The cat "
    generated = subprocess.run([FSDPP, "generate", run_dir, "--prompt", prompt, "--temperature", "0",
                                "--tokens", "64"], capture_output=True, check=True).stdout
    ours_ids = list(generated[len(prompt):-1])
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        theirs_ids = hf_model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, ids.shape[1]:]
    check(ours_ids == theirs_ids.tolist(), f"export {name}: 64 greedy tokens identical")
    tok = AutoTokenizer.from_pretrained(exported)
    text = "héllo wörld\n\x01\t ▁ {}  end"
    check(tok.encode(text, add_special_tokens=False) == list(text.encode()),
          f"export {name}: AutoTokenizer's ids are fsdpp's bytes")
    check(tok.decode(list(text.encode())) == text, f"export {name}: AutoTokenizer decodes them back")

# Sharded and bfloat16.
run_dir = path("runs", "moe-gqa")
sharded = path("export", "moe-sharded")
run(FSDPP, "export", run_dir, "-o", sharded, "--max-shard-size", "60KB")
index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
files = sorted(set(index["weight_map"].values()))
check(len(files) > 2 and not os.path.exists(os.path.join(sharded, "model.safetensors")),
      f"export: sharded over {len(files)} files with an index")
theirs, _ = hf_logits(sharded, tokens)
check(max_diff(fsdpp_logits(run_dir, tokens), theirs) <= 1e-5, "export: the sharded checkpoint loads the same")
half = path("export", "moe-bf16")
run(FSDPP, "export", run_dir, "-o", half, "--dtype", "bfloat16")
tensors = load_file(os.path.join(half, "model.safetensors"))
check(all(t.dtype == torch.bfloat16 for t in tensors.values()) and
      json.load(open(os.path.join(half, "config.json")))["dtype"] == "bfloat16", "export --dtype bfloat16")

# SentencePiece tokenizers (the bundled BPE model; a unigram model trained here): the exported
# tokenizer.json gives fsdpp's ids for every text but one with a literal U+2581 (docs/checkpoints.md).
docs = os.path.join(SOURCE, "docs")
unigram_model = path("unigram.model")
run(FSDPP, "tokenizer", "train", "--vocab", "400", "--type", "unigram", docs, "-o", unigram_model)
texts = [open(os.path.join(docs, f), encoding="utf-8").read() for f in sorted(os.listdir(docs))]
texts += ["  leading and  doubled   spaces  ", "trailing\n\n\nnewlines\n", "naïve café — 東京 🚀 x²",
          "tabs\tand\r\ncarriage returns", "digits 1234567890 3.14159", ""]
for kind, model_file, vocab in [("bpe", os.path.join(SOURCE, "recipes", "tokenizers", "fortunes-bpe-2048.model"), 2048),
                                ("unigram", unigram_model, 400)]:
    name = f"piece-{kind}"
    run(FSDPP, "run", write_recipe(name, dict(dense, vocab_size=vocab),
                                   data={"source": "files", "paths": [docs], "tokenizer": model_file,
                                         "synthetic_bytes": 1024}))
    exported = path("export", name)
    run(FSDPP, "export", path("runs", name), "-o", exported)
    tok = AutoTokenizer.from_pretrained(exported)
    mismatched = []
    for i, text in enumerate(texts):
        with open(path("text.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        ours_ids = [int(x) for x in run(PROBE, "encode", model_file, path("text.txt")).stdout.split()]
        theirs_ids = tok.encode(text, add_special_tokens=False)
        if ours_ids != theirs_ids or tok.decode(theirs_ids) != text:
            mismatched.append(i)
    check(not mismatched, f"export {name}: AutoTokenizer gives fsdpp's ids for {len(texts)} texts "
                          f"({sum(len(t) for t in texts)} characters) and decodes them back; mismatched: {mismatched}")
    theirs, _ = hf_logits(exported, tokens)
    check(max_diff(fsdpp_logits(path("runs", name), tokens), theirs) <= 1e-5, f"export {name}: logits")
    check(os.path.exists(os.path.join(exported, "tokenizer.model")), f"export {name}: the model file beside it")

# ---------------------------------------------------------------- (2) import
torch.manual_seed(1)
llama_cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                        rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False, bos_token_id=None,
                        eos_token_id=None)
llama = LlamaForCausalLM(llama_cfg)
randomize(llama)
llama_dir = path("hf", "llama")
llama.save_pretrained(llama_dir)
mixtral_cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=128, rope_theta=1e6,
                            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, sliding_window=None)
mixtral = MixtralForCausalLM(mixtral_cfg)
randomize(mixtral)
mixtral_dir = path("hf", "mixtral")
mixtral.save_pretrained(mixtral_dir, max_shard_size="50KB")
check(os.path.exists(os.path.join(mixtral_dir, "model.safetensors.index.json")), "import: the Mixtral is sharded")
# Tied embeddings: save_pretrained writes no lm_head.weight. One stage holds the shared weight, so
# this one runs at dp 1 and dp 2 only (pp 2 is refused; docs/model.md).
tied_cfg = LlamaConfig(**dict(llama_cfg.to_dict(), tie_word_embeddings=True, num_key_value_heads=4))
tied = LlamaForCausalLM(tied_cfg)
randomize(tied)
tied.tie_weights()
tied_dir = path("hf", "llama-tied")
tied.save_pretrained(tied_dir)
check("lm_head.weight" not in load_file(os.path.join(tied_dir, "model.safetensors")),
      "import: the tied Llama's checkpoint holds no lm_head.weight")

for name, model, d in [("llama", llama, llama_dir), ("mixtral", mixtral, mixtral_dir),
                       ("llama-tied", tied, tied_dir)]:
    with torch.no_grad():
        theirs = model(tokens).logits.float()
    direct = fsdpp_logits(d, tokens)
    diff = max_diff(direct, theirs)
    check(diff <= 1e-5 and theirs.abs().max().item() > 0.5,
          f"import {name}: fsdpp's logits within 1e-5 of transformers' ({diff:.2e})")
    file = path(f"{name}.safetensors")
    out = run(FSDPP, "import", d, "-o", file).stdout
    check(max_diff(fsdpp_logits(file, tokens), theirs) <= 1e-5, f"import {name}: the imported file, the same")
    # A training step from it, at dp 1, dp 2 and pp 2: the same first loss.
    losses = {}
    # Each rank reads only its shards' rows: the fused projection's rows span q, k and v at dp 2,
    # and with experts over ep 2 a rank's rows are some of the experts.
    layouts = [("dp1", {}), ("dp2", {"dp": 2})] + ([] if name == "llama-tied" else [("pp2", {"pp": 2, "microbatches": 2})])
    if name == "mixtral":
        layouts.append(("ep2", {"dp": 2, "ep": 2}))
    for layout, parallel in layouts:
        recipe = write_recipe(f"{name}-{layout}", {"init_from": d}, parallel=parallel,
                              train={"steps": 1, "global_batch": 4}, eval={"interval": 1},
                              checkpoint={"interval": 1})
        run(FSDPP, "run", recipe)
        losses[layout] = first_loss(path("runs", f"{name}-{layout}"))
    spread = max(losses.values()) - min(losses.values())
    check(spread <= 1e-4 * max(losses.values()), f"import {name}: the same first loss at {losses}")

# ---------------------------------------------------------------- (3) round trip
for name, d, extra in [("llama", llama_dir, []), ("mixtral", mixtral_dir, ["--max-shard-size", "50KB"]),
                       ("llama-tied", tied_dir, [])]:
    back = path("roundtrip", name)
    run(FSDPP, "export", path(f"{name}.safetensors"), "-o", back, *extra)

    a, b = tensors_of(d), tensors_of(back)
    same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    check(same, f"round trip {name}: {len(a)} tensors bit for bit")
    ca, cb = json.load(open(os.path.join(d, "config.json"))), json.load(open(os.path.join(back, "config.json")))
    keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"]
    check(all(ca.get(k) == cb.get(k) for k in keys), f"round trip {name}: config.json's architecture")

# ---------------------------------------------------------------- (4) bad input


def broken_copy(name, edit_config=None, edit_tensors=None):
    d = path("bad", name)
    shutil.copytree(llama_dir, d)
    if edit_config:
        c = json.load(open(os.path.join(d, "config.json")))
        edit_config(c)
        json.dump(c, open(os.path.join(d, "config.json"), "w"))
    if edit_tensors:
        f = os.path.join(d, "model.safetensors")
        t = load_file(f)
        edit_tensors(t)
        save_file(t, f, metadata={"format": "pt"})
    return d


def refused(name, d, *expected):
    out = path("bad", name + ".safetensors")
    p = run(FSDPP, "import", d, "-o", out, expect=None)
    check(p.returncode != 0 and all(e in p.stderr for e in expected) and not os.path.exists(out),
          f"bad input {name}: refused naming {expected}: {p.stderr.strip()}")


refused("missing", broken_copy("missing", edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "model.layers.1.mlp.up_proj.weight is missing")
refused("shape", broken_copy("shape", edit_tensors=lambda t: t.update(
    {"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)})),
        "model.layers.0.self_attn.k_proj.weight has shape [32, 64]", "[16, 64]")
refused("extra", broken_copy("extra", edit_tensors=lambda t: t.update({"model.layers.0.extra.bias": torch.zeros(3)})),
        "model.layers.0.extra.bias")
refused("model_type", broken_copy("model_type", edit_config=lambda c: c.update(model_type="gemma2")),
        "model_type \"gemma2\"", "config.json")
refused("rope_scaling", broken_copy("rope_scaling", edit_config=lambda c: c.update(
    rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0})), "rope_parameters", "yarn")
refused("bias", broken_copy("bias", edit_config=lambda c: c.update(attention_bias=True)), "attention_bias true")
truncated = broken_copy("truncated")
with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(truncated, "model.safetensors")) // 2)
refused("truncated", truncated, "model.safetensors")

# Export refusals: a config no transformers class computes, an existing directory.
run(FSDPP, "run", write_recipe("dense-first", dict(moe, dense_layers=1, ffn_hidden=64)))
out = path("export", "dense-first")
p = run(FSDPP, "export", path("runs", "dense-first"), "-o", out, expect=None)
check(p.returncode == 2 and "model.dense_layers" in p.stderr and not os.path.exists(out),
      f"export refuses dense first layers under Mixtral: {p.stderr.strip()}")
p = run(FSDPP, "export", path("runs", "moe-gqa"), "-o", path("export", "moe-gqa"), expect=None)
check(p.returncode == 2 and "exists" in p.stderr, f"export refuses an existing directory: {p.stderr.strip()}")
leftovers = [f for f in os.listdir(path("export")) if f.startswith(".")]
check(not leftovers, f"export leaves no temporary directory ({leftovers})")
p = run(FSDPP, "validate", write_recipe("conflict", {"init_from": llama_dir, "heads": 4}), expect=None)
check(p.returncode == 2 and "model.heads" in p.stderr and "transformers checkpoint" in p.stderr,
      f"a recipe that contradicts the checkpoint's architecture: {p.stderr.strip()}")

# ---------------------------------------------------------------- the bundled recipe
finetuned = path("runs", "finetune-hf")
run(FSDPP, "run", os.path.join(SOURCE, "recipes", "finetune-hf.json"), "train.steps=4",
    f"logging.output_dir={finetuned}", "checkpoint.interval=4")
run(FSDPP, "export", finetuned, "-o", path("export", "finetune-hf"))
theirs, _ = hf_logits(path("export", "finetune-hf"), tokens)
check(max_diff(fsdpp_logits(finetuned, tokens), theirs) <= 1e-5, "recipes/finetune-hf.json: trains and exports")

# ---------------------------------------------------------------- (5) a published model's tokenizer.json
# As a model from the hub comes: a Llama whose tokenizer is a byte-level BPE (trained here by
# tokenizers itself) with an end-of-text token, saved by PreTrainedTokenizerFast, and an embedding
# rounded up past the tokenizer's last id. init_from takes the directory's tokenizer unasked.
from tokenizers import Tokenizer as HFTokenizer, decoders as hf_decoders, models as hf_models  # noqa: E402
from tokenizers import pre_tokenizers as hf_pre, trainers as hf_trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

bpe = HFTokenizer(hf_models.BPE())
bpe.pre_tokenizer = hf_pre.ByteLevel(add_prefix_space=False)
bpe.decoder = hf_decoders.ByteLevel()
bpe.train_from_iterator(texts, hf_trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=hf_pre.ByteLevel.alphabet(), show_progress=False))
fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
torch.manual_seed(2)
published = LlamaForCausalLM(LlamaConfig(**dict(llama_cfg.to_dict(), vocab_size=512, eos_token_id=fast.eos_token_id)))
randomize(published)
published_dir = path("hf", "published")
published.save_pretrained(published_dir)
fast.save_pretrained(published_dir)
run(FSDPP, "run", write_recipe("published", {"init_from": published_dir},
                               data={"source": "files", "paths": [docs], "synthetic_bytes": 1024}))
mismatched = []
for i, text in enumerate(texts):
    with open(path("text.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    ours_ids = [int(x) for x in run(PROBE, "encode", published_dir, path("text.txt")).stdout.split()]
    if ours_ids != fast.encode(text, add_special_tokens=False):
        mismatched.append(i)
check(not mismatched, f"published tokenizer: fsdpp's ids are AutoTokenizer's for {len(texts)} texts; "
                      f"mismatched: {mismatched}")
exported = path("export", "published")
run(FSDPP, "export", path("runs", "published"), "-o", exported)
same = open(os.path.join(exported, "tokenizer.json"), "rb").read() == open(
    os.path.join(published_dir, "tokenizer.json"), "rb").read()
check(same, "published tokenizer: export writes its tokenizer.json byte for byte")
tok = AutoTokenizer.from_pretrained(exported)
check(tok.eos_token == "<|endoftext|>" and json.load(open(os.path.join(exported, "config.json")))["eos_token_id"] ==
      fast.eos_token_id, "published tokenizer: export keeps its end-of-text token")
prompt = "The cat "
# Bytes, not text mode: a generated "\r" must not become "\n".
generated = subprocess.run([FSDPP, "generate", path("runs", "published"), "--prompt", prompt, "--temperature", "0",
                            "--tokens", "32"], capture_output=True, check=True).stdout.decode()
_, hf_model = hf_logits(exported, tokens)
ids = torch.tensor([fast.encode(prompt, add_special_tokens=False)])
with torch.no_grad():
    new = hf_model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=fast.eos_token_id,
                            pad_token_id=fast.eos_token_id)[0, ids.shape[1]:].tolist()
if fast.eos_token_id in new:
    new = new[:new.index(fast.eos_token_id)]
check(generated == prompt + tok.decode(new) + "\n",
      f"published tokenizer: fsdpp generate's greedy text is transformers' ({len(new)} tokens)")

print(f"transformers {transformers.__version__}, torch {torch.__version__}: {len(failures)} failure(s)")
shutil.rmtree(WORK, ignore_errors=True)
sys.exit(1 if failures else 0)
