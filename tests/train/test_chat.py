"""Conversations as training data (data.source "chat"), checked by transformers itself.

    python test_chat.py FSDPP_BIN PROBE_BIN SOURCE_DIR

(1) samples: every row fsdpp trains on is a conversation as transformers' apply_chat_template(
    tokenize=True, return_assistant_tokens_mask=True) tokenizes and masks it, for a ChatML template
    with {% generation %} blocks and for the same template without them (fsdpp then finds each
    assistant turn as what it adds to the conversation before it);
(2) loss and gradients: the first step of `fsdpp run` from a transformers-made Llama reports the loss
    and gradient norm of transformers' model on the same global batch with labels -100 (the mean over
    the counted targets), at dp 1, dp 2, grad_accum 2, cpu.microbatch_threads 2 and pp 2; the second
    step's loss is the same at every layout; a transformers Mixtral's first loss at dp 2 and with
    experts over ep 2, and the same second loss at both; packed (data.pack), each row holds whole
    conversations from position 0, and the first loss at dp 1, dp 2 with activation checkpointing
    and pp 2 is transformers' on the packed batch given its position_ids; `fsdpp tokenize --chat`
    writes shards whose rows are the same, trained on from data.path;
(3) the bundled recipe recipes/finetune-chat.json: its loss falls, `generate --chat` (a prompt, and a
    file of conversations) gives transformers' greedy replies token for token, and its export loads in
    transformers;
(4) bad input: exit 2 naming the file, the line and what is wrong.
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from harness import Harness
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                          MixtralForCausalLM, PreTrainedTokenizerFast)

FSDPP, PROBE, SOURCE = sys.argv[1:4]
H = Harness("fsdpp-chat-")
WORK, failures, check, run, path = H.work, H.failures, H.check, H.run, H.path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics", "rank0.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


# A model as published: a Llama with its own byte-level BPE tokenizer and ChatML template.
docs = os.path.join(SOURCE, "docs")
lines = [l.strip() for f in sorted(os.listdir(docs)) for l in open(os.path.join(docs, f), encoding="utf-8")
         if 20 < len(l.strip()) < 100]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                   "<|im_end|>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                   show_progress=False))
fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(fast), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=fast.eos_token_id))
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
model_dir = path("model")
model.save_pretrained(model_dir)
fast.chat_template = PLAIN
fast.save_pretrained(model_dir)

conversations = []
for i in range(0, 96, 3):
    if i % 9 == 3:
        conversations.append({"prompt": lines[i], "completion": lines[i + 1]})
    else:
        conversations.append({"messages": [{"role": "system", "content": "Answer briefly."}] * (i % 2) + [
            {"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]},
            {"role": "user", "content": lines[i + 2][:40]}, {"role": "assistant", "content": lines[i][:30]}]})
data = path("chat.jsonl")
with open(data, "w") as f:
    for c in conversations:
        f.write(json.dumps(c) + "\n")


def messages(c):
    if "messages" in c:
        return c["messages"]
    return [{"role": "user", "content": c["prompt"]}, {"role": "assistant", "content": c["completion"]}]


def write_recipe(name, parallel=None, train=None, cpu=None, data_extra=None, template=None, init_from=None):
    recipe = {"model": {"init_from": init_from or model_dir},
              "data": {"source": "chat", "paths": [data], "seq_len": 224, "val_fraction": 0.1, **(data_extra or {})},
              "parallel": {"dp": 1, "pp": 1, **(parallel or {})},
              "optim": {"lr": 1e-2, "warmup_steps": 0},
              "train": {"steps": 2, "global_batch": 8, **(train or {})},
              "eval": {"interval": 2, "batches": 1},
              "checkpoint": {"interval": 2},
              "logging": {"interval": 1, "output_dir": path("runs", name)}}
    if cpu:
        recipe["cpu"] = cpu
    if template:
        recipe["data"]["chat_template"] = template
    file = path(f"{name}.json")
    json.dump(recipe, open(file, "w"))
    return file


# ---------------------------------------------------------------- (1) samples
T = 224
expected = set()
for c in conversations:
    enc = fast.apply_chat_template(messages(c), chat_template=CHATML, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    inputs = (ids + [fast.eos_token_id] * T)[:T]
    targets = [(ids[t + 1] if t + 1 < len(ids) and mask[t + 1] else -100) for t in range(T)]
    expected.add((tuple(inputs), tuple(targets)))
with open(path("chatml-generation.jinja"), "w") as f:
    f.write(CHATML)
for name, template in [("prefixes", None), ("generation-blocks", path("chatml-generation.jinja"))]:
    recipe = write_recipe(f"rows-{name}", train={"global_batch": 8}, template=template)
    run(PROBE, "chat-batch", recipe, 0, path("batch.safetensors"))
    rows = load_file(path("batch.safetensors"))
    got = {(tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(rows["inputs"], rows["targets"])}
    check(got <= expected and len(got) == 8,
          f"samples ({name}): the 8 rows of step 0 are transformers' tokens and assistant masks "
          f"({len(got - expected)} differ)")

# ---------------------------------------------------------------- (2) loss and gradients
recipe = write_recipe("reference")
run(PROBE, "chat-batch", recipe, 0, path("batch.safetensors"))
batch = load_file(path("batch.safetensors"))
model.zero_grad()
logits = model(batch["inputs"]).logits.float()
targets = batch["targets"]
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         ignore_index=-100, reduction="sum") / (targets != -100).sum()
loss.backward()
grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
print(f"transformers: loss {loss.item():.6f}, gradient norm {grad_norm:.6f}, "
      f"{(targets != -100).sum().item()} of {targets.numel()} targets counted")
second = {}
layouts = [("dp1", {}, {}, None), ("dp2", {"dp": 2}, {}, None), ("grad_accum2", {}, {"grad_accum": 2}, None),
           ("threads2", {}, {"grad_accum": 2}, {"microbatch_threads": 2}),
           ("pp2", {"pp": 2, "microbatches": 2}, {}, None)]
for name, parallel, train, cpu in layouts:
    run(FSDPP, "run", write_recipe(name, parallel, train, cpu))
    m = metrics(path("runs", name))
    check(abs(m[0]["loss"] - loss.item()) <= 2e-5 and abs(m[0]["grad_norm"] - grad_norm) <= 1e-4 * grad_norm,
          f"{name}: first loss {m[0]['loss']:.6f} and gradient norm {m[0]['grad_norm']:.6f} are transformers'")
    second[name] = m[1]["loss"]
spread = max(second.values()) - min(second.values())
check(spread <= 2e-5, f"the second step's loss is the same at every layout: {second}")

# Experts over ep 2: a transformers Mixtral (no auxiliary loss) on the same conversations.
torch.manual_seed(1)
mixtral = MixtralForCausalLM(MixtralConfig(
    vocab_size=len(fast), hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
    tie_word_embeddings=False, sliding_window=None, router_aux_loss_coef=0.0, bos_token_id=None,
    eos_token_id=fast.eos_token_id))
with torch.no_grad():
    for p in mixtral.parameters():
        p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
moe_dir = path("moe")
mixtral.save_pretrained(moe_dir)
fast.save_pretrained(moe_dir)
with torch.no_grad():
    moe_logits = mixtral(batch["inputs"]).logits.float()
moe_loss = torch.nn.functional.cross_entropy(moe_logits.reshape(-1, moe_logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum").item() / (targets != -100).sum().item()
moe_second = {}
for name, parallel in [("moe-dp2", {"dp": 2}), ("moe-ep2", {"dp": 2, "ep": 2})]:
    run(FSDPP, "run", write_recipe(name, parallel, init_from=moe_dir))
    m = metrics(path("runs", name))
    check(abs(m[0]["loss"] - moe_loss) <= 2e-5, f"{name}: first loss {m[0]['loss']:.6f} is transformers' {moe_loss:.6f}")
    moe_second[name] = m[1]["loss"]
check(abs(moe_second["moe-dp2"] - moe_second["moe-ep2"]) <= 2e-5,
      f"experts over ep 2: the second step's loss as at dp 2: {moe_second}")

# ---------------------------------------------------------------- (2b) packed samples
# Several conversations per row, positions restarting at each: transformers reads such a batch from
# its position_ids (one sequence where they count up by one) and masks attention to each sequence,
# when it runs without a cache as in training.
recipe = write_recipe("packed-reference", data_extra={"pack": True})
run(PROBE, "chat-batch", recipe, 0, path("packed.safetensors"))
packed = load_file(path("packed.safetensors"))
whole = [fast.apply_chat_template(messages(c), chat_template=PLAIN, tokenize=True, return_dict=True)["input_ids"]
         for c in conversations]
rows_ok, seen = True, 0
for ins, tgs, pos in zip(packed["inputs"].tolist(), packed["targets"].tolist(), packed["positions"].tolist()):
    starts = [i for i, p in enumerate(pos) if p == 0] + [T]
    for a, b in zip(starts, starts[1:]):
        ids = next((w for w in whole if w[:b - a] == ins[a:b] and len(w) >= b - a), None)
        if ids is None:  # the padding: pad tokens and nothing counted
            rows_ok &= all(t == fast.pad_token_id or t == fast.eos_token_id for t in ins[a:b]) and \
                all(t == -100 for t in tgs[a:b])
            continue
        seen += 1
        # The whole conversation (its last token only a target at the row's end), and no target that
        # is the next conversation's first token.
        rows_ok &= ins[a:b] == ids[:b - a] and (b - a == len(ids) or (b == T and b - a == len(ids) - 1))
        rows_ok &= all(t == -100 or t == ids[i + 1 - a] for i, t in enumerate(tgs[a:b], start=a))
        rows_ok &= tgs[b - 1] == -100 or b - a < len(ids)
check(rows_ok and seen > 8, f"packed samples: {seen} whole conversations in 8 rows, each from position 0")
with torch.no_grad():
    hf_packed = model(packed["inputs"], position_ids=packed["positions"], use_cache=False).logits.float()
    hf_unaware = model(packed["inputs"]).logits.float()
ptargets = packed["targets"]


def loss_of(lg):
    return (torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), ptargets.reshape(-1), ignore_index=-100,
                                              reduction="sum") / (ptargets != -100).sum()).item()


packed_loss = loss_of(hf_packed)
# What a packing that let conversations see each other would report: the check below can tell.
check(abs(loss_of(hf_unaware) - packed_loss) > 1e-3,
      f"packed: attending across conversations changes the loss ({loss_of(hf_unaware):.6f} vs {packed_loss:.6f})")
packed_second = {}
for name, parallel, train in [("packed-dp1", {}, {}), ("packed-dp2", {"dp": 2}, {"activation_checkpointing": 1}),
                              ("packed-pp2", {"pp": 2, "microbatches": 2}, {})]:
    run(FSDPP, "run", write_recipe(name, parallel, train, data_extra={"pack": True}))
    m = metrics(path("runs", name))
    check(abs(m[0]["loss"] - packed_loss) <= 2e-5,
          f"{name}: first loss {m[0]['loss']:.6f} is transformers' on the packed batch {packed_loss:.6f}")
    packed_second[name] = m[1]["loss"]
check(max(packed_second.values()) - min(packed_second.values()) <= 2e-5,
      f"packed: the second step's loss is the same at every layout: {packed_second}")

# ---------------------------------------------------------------- (2c) shards of conversations
# `fsdpp tokenize --chat` renders and masks the conversations once; data.path then reads them.
shard_dir = path("chat-shards")
run(FSDPP, "tokenize", "--chat", "--tokenizer", model_dir, data, "-o", shard_dir, "--val-fraction", "0.1",
    "--shard-tokens", "1000")
names = sorted(os.listdir(shard_dir))
bins = [n for n in names if n.endswith(".bin")]
check(len(bins) > 2 and all(n[:-4] + ".mask" in names for n in bins),
      f"tokenize --chat: {len(bins)} shards, each with its mask beside it")
recipe = write_recipe("from-shards", data_extra={"paths": [], "path": shard_dir})
run(PROBE, "chat-batch", recipe, 0, path("shard-batch.safetensors"))
rows = load_file(path("shard-batch.safetensors"))
got = {(tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(rows["inputs"], rows["targets"])}
check(got <= expected and len(got) == 8,
      f"from shards: the 8 rows of step 0 are transformers' tokens and assistant masks ({len(got - expected)} differ)")
recipe = write_recipe("from-shards-packed", data_extra={"paths": [], "path": shard_dir, "pack": True})
run(PROBE, "chat-batch", recipe, 0, path("shard-packed.safetensors"))
sp = load_file(path("shard-packed.safetensors"))
with torch.no_grad():
    lg = model(sp["inputs"], position_ids=sp["positions"], use_cache=False).logits.float()
shard_loss = (torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), sp["targets"].reshape(-1),
                                                ignore_index=-100, reduction="sum") / (sp["targets"] != -100).sum()).item()
run(FSDPP, "run", write_recipe("shards-dp2", {"dp": 2}, data_extra={"paths": [], "path": shard_dir, "pack": True}))
m = metrics(path("runs", "shards-dp2"))
check(abs(m[0]["loss"] - shard_loss) <= 2e-5,
      f"from shards, packed, dp 2: first loss {m[0]['loss']:.6f} is transformers' {shard_loss:.6f}")
# Shards and sources that do not go together, and a mask cut short.
plain_dir = path("plain-shards")
run(FSDPP, "tokenize", "--tokenizer", model_dir, docs, "-o", plain_dir)
bad_shards = {
    "plain shards as conversations": ({"paths": [], "path": plain_dir}, "without conversations' masks"),
    "conversations as plain shards": ({"source": "shards", "paths": [], "path": shard_dir}, "holds conversations"),
}
for what, (extra, needle) in bad_shards.items():
    p = run(FSDPP, "run", write_recipe("bad-shards", data_extra=extra), expect=None)
    check(p.returncode == 2 and needle in p.stderr, f"{what}: exit {p.returncode}, {p.stderr.strip()[-200:]!r}")
mask = os.path.join(shard_dir, bins[-1][:-4] + ".mask")
with open(mask, "r+b") as f:
    f.truncate(os.path.getsize(mask) - 1)
p = run(FSDPP, "run", write_recipe("cut-mask", data_extra={"paths": [], "path": shard_dir}), expect=None)
check(p.returncode == 2 and os.path.basename(mask) in p.stderr and "one byte each" in p.stderr,
      f"a mask cut short: exit {p.returncode}, {p.stderr.strip()[-200:]!r}")
with open(path("bad-line.jsonl"), "w") as f:
    f.write(json.dumps(conversations[0]) + "\n{\"messages\": 3}\n")
p = run(FSDPP, "tokenize", "--chat", "--tokenizer", model_dir, path("bad-line.jsonl"), "-o", path("bad-out"),
        expect=None)
check(p.returncode == 2 and "bad-line.jsonl:2" in p.stderr and not os.path.exists(path("bad-out", "index.json")),
      f"tokenize --chat, a bad line: exit {p.returncode}, {p.stderr.strip()[-200:]!r}")

# ---------------------------------------------------------------- (3) the bundled recipe
run_dir = path("runs", "finetune-chat")
run(FSDPP, "run", os.path.join(SOURCE, "recipes", "finetune-chat.json"), "train.steps=40",
    f"logging.output_dir={run_dir}", "checkpoint.interval=40", "eval.interval=40")
m = metrics(run_dir)
check(m[-1]["loss"] < m[0]["loss"] - 0.5, f"recipes/finetune-chat.json: loss {m[0]['loss']:.3f} -> {m[-1]['loss']:.3f}")
exported = path("export", "finetune-chat")
run(FSDPP, "export", run_dir, "-o", exported, "--format", "hf")
tok = AutoTokenizer.from_pretrained(exported)
hf_model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
question = "Tell me a fortune."
# Bytes, not text mode: a generated "\r" must not become "\n".
reply = subprocess.run([FSDPP, "generate", run_dir, "--chat", "--prompt", question, "--temperature", "0",
                        "--max-new-tokens", "48"], capture_output=True, check=True).stdout.decode()
ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
                              return_dict=True, return_tensors="pt")["input_ids"]
with torch.no_grad():
    new = hf_model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
if tok.eos_token_id in new:
    new = new[:new.index(tok.eos_token_id)]
check(reply == tok.decode(new) + "\n", f"generate --chat: transformers' greedy reply ({len(new)} tokens): {reply!r}")
check(tok.chat_template is not None, "export: the chat template goes with the tokenizer")
# A file of conversations: each continued with transformers' greedy reply.
asks = [{"messages": [{"role": "user", "content": "Say something wise."}]},
        {"prompt": "Cheer me up."},
        {"messages": [{"role": "user", "content": "Tell me a fortune."}, {"role": "assistant", "content": "Soon."},
                      {"role": "user", "content": "Another one."}]}]
with open(path("asks.jsonl"), "w") as f:
    f.write("\n".join(json.dumps(a) for a in asks) + "\n")
out = subprocess.run([FSDPP, "generate", run_dir, "--chat", "--conversations", path("asks.jsonl"), "--temperature",
                      "0", "--max-new-tokens", "24"], capture_output=True, check=True).stdout.decode()
answered = [json.loads(line)["messages"] for line in out.splitlines()]
same = len(answered) == len(asks)
for ask, got in zip(asks, answered):
    conv = messages(ask) if "messages" in ask else [{"role": "user", "content": ask["prompt"]}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True,
                                  return_tensors="pt")["input_ids"]
    with torch.no_grad():
        new = hf_model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id)]
    same &= got[:-1] == conv and got[-1] == {"role": "assistant", "content": tok.decode(new)}
check(same, f"generate --chat --conversations: {len(answered)} conversations continued with transformers' replies")

# ---------------------------------------------------------------- (4) bad input
bad = {
    "not-json.jsonl": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                       '{"messages": [\n', [":2:", "not JSON"]),
    "no-role.jsonl": ('{"messages": [{"content": "hi"}]}\n', [":1:", "messages[0]"]),
    "too-long.jsonl": (json.dumps({"messages": [{"role": "user", "content": "x " * 400},
                                                {"role": "assistant", "content": "y"}]}) + "\n",
                       [":1:", "longer than data.seq_len + 1"]),
    "no-assistant.jsonl": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n",
                           [":1:", "no assistant tokens"]),
    "refused.jsonl": (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                               {"role": "assistant", "content": "c"}]}) + "\n",
                      [":1:", "roles must alternate"]),
}
alternating = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
with open(path("alternating.jinja"), "w") as f:
    f.write(alternating)
for file, (text, needles) in bad.items():
    with open(path(file), "w") as f:
        f.write(text)
    recipe = write_recipe(f"bad-{file}", data_extra={"paths": [path(file)]},
                          template=path("alternating.jinja") if file == "refused.jsonl" else None)
    p = run(FSDPP, "run", recipe, expect=None)
    check(p.returncode == 2 and all(n in p.stderr for n in needles + [file]),
          f"bad input {file}: exit {p.returncode}, {p.stderr.strip()[-300:]!r}")

print(f"{len(failures)} failure(s)")
shutil.rmtree(WORK, ignore_errors=True)
sys.exit(1 if failures else 0)
