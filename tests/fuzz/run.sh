#!/usr/bin/env bash
# Builds a libFuzzer target with clang, AddressSanitizer and UndefinedBehaviorSanitizer (the code
# under test compiled from source; the rest of fsdpp and the LibTorch it was configured with linked
# as built) and runs it for a fixed number of inputs from a seed corpus.
#   tests/fuzz/run.sh BUILD_DIR recipe|checkpoint|shards|tokenizer|tokenizer_json|chat|schedule|hf_config|lock RUNS
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "$1" && pwd)
target=$2
runs=$3
out=$build/fuzz
mkdir -p "$out"
cxx=$(command -v clang++-14 || command -v clang++ || true)
if [[ -z $cxx ]]; then
  echo "fuzz: clang++ is not installed (scripts/setup.sh installs clang-14 and libclang-rt-14-dev)" >&2
  exit 1
fi

extra=()
case $target in
  recipe)
    # The parser loads data.tokenizer to check its vocabulary: the plugin is linked in, not opened
    # (piece_plugin_linked.cpp says why).
    sources=("$src/tests/fuzz/recipe_fuzz.cpp" "$src/src/train/recipe.cpp" "$src/src/train/recipe_sections.cpp" "$src/src/train/recipe_model.cpp"
      "$src/src/train/tokenizer.cpp" "$src/src/train/sentencepiece_tokenizer.cpp" "$src/tests/fuzz/piece_plugin_linked.cpp")
    extra=(-lsentencepiece_train -lsentencepiece) ;;
  checkpoint) sources=("$src/tests/fuzz/checkpoint_fuzz.cpp" "$src/src/base/safetensors.cpp" "$src/src/fsdp/checkpoint.cpp") ;;
  shards) sources=("$src/tests/fuzz/shards_fuzz.cpp" "$src/src/train/shards.cpp") ;;
  tokenizer)
    # The plugin's source, instrumented, with SentencePiece linked into the target itself.
    sources=("$src/tests/fuzz/tokenizer_fuzz.cpp" "$src/src/train/sentencepiece_tokenizer.cpp")
    extra=(-lsentencepiece_train -lsentencepiece) ;;
  tokenizer_json)
    sources=("$src/tests/fuzz/tokenizer_json_fuzz.cpp" "$src"/src/train/text/*.cpp)
    extra=(-lpcre2-8 -lutf8proc) ;;
  chat)
    sources=("$src/tests/fuzz/chat_fuzz.cpp" "$src/src/train/chat_data.cpp" "$src"/src/train/text/template_*.cpp) ;;
  schedule) sources=("$src/tests/fuzz/schedule_fuzz.cpp") ;;  # header-only
  hf_config)
    sources=("$src/tests/fuzz/hf_config_fuzz.cpp" "$src/src/train/hf_config.cpp" "$src/src/train/recipe.cpp"
      "$src/src/train/recipe_sections.cpp" "$src/src/train/recipe_model.cpp" "$src/src/train/tokenizer.cpp" "$src/src/train/sentencepiece_tokenizer.cpp"
      "$src/tests/fuzz/piece_plugin_linked.cpp")
    extra=(-lsentencepiece_train -lsentencepiece) ;;
  lock) sources=("$src/tests/fuzz/lock_fuzz.cpp" "$src/src/train/run_lock.cpp" "$src/src/base/files.cpp") ;;
  *) echo "fuzz: unknown target $target (recipe, checkpoint, shards, tokenizer, tokenizer_json, chat, schedule, hf_config, lock)" >&2; exit 2 ;;
esac

# The LibTorch that CMake found (cmake/fsdppDependencies.cmake): Torch_DIR is <torch>/share/cmake/Torch.
torch_dir=$(sed -n 's/^Torch_DIR:PATH=//p' "$build/CMakeCache.txt")
torch=$(cd "$torch_dir/../../.." && pwd)
# The same backend macros as the library, so that the code compiled here matches the code it links.
with_nccl=$(grep -q -- '-DFSDPP_WITH_NCCL=1' "$build/build.ninja" && echo 1 || echo 0)

bin=$out/${target}_fuzz
stamp=$(cat "${sources[@]}" "$build/libfsdpp.so" | md5sum | cut -d' ' -f1)
if [[ ! -x $bin || $(cat "$bin.stamp" 2>/dev/null) != "$stamp" ]]; then
  echo "fuzz: building $bin"
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -DFSDPP_SOURCE_DIR="\"$src\"" -DFSDPP_WITH_GLOO=1 -DFSDPP_WITH_NCCL=$with_nccl -DFMT_HEADER_ONLY=1 \
    -I"$src/include" -isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include" \
    "${sources[@]}" "$build/libfsdpp.so" -Wl,-rpath,"$build" \
    -L"$torch/lib" -Wl,-rpath,"$torch/lib" -ltorch -ltorch_cpu -lc10 "${extra[@]}" -ldl -lpthread -o "$bin"
  echo "$stamp" > "$bin.stamp"
fi

corpus=$out/${target}_corpus
rm -rf "$corpus"
mkdir -p "$corpus"
if [[ $target == recipe ]]; then
  cp "$src"/tests/train/hostile_recipes/*.json "$src"/recipes/*.json "$corpus"/
elif [[ $target == schedule ]]; then
  # Tables the tests and PyTorch 2.15 wrote, as CSV (mode 0x04: pp 2) and as JSON (mode 0x05).
  for f in "$src"/tests/pipeline/*.csv; do { printf '\x04'; cat "$f"; } > "$corpus/$(basename "$f")"; done
  printf '\x06' > "$corpus/fsdp"; printf '0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n' >> "$corpus/fsdp"
  printf '\x05{"ranks": [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]}' > "$corpus/json"
elif [[ $target == hf_config ]]; then
  # The configs transformers writes for the two families fsdpp imports.
  printf '%s' '{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":256,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":128,"rms_norm_eps":1e-6,"rope_theta":10000.0,"tie_word_embeddings":false}' > "$corpus/llama"
  printf '%s' '{"architectures":["MixtralForCausalLM"],"model_type":"mixtral","vocab_size":256,"hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,"num_local_experts":4,"num_experts_per_tok":2,"max_position_embeddings":128,"rope_theta":1000000.0,"sliding_window":null}' > "$corpus/mixtral"
elif [[ $target == lock ]]; then
  printf '%s\n' '{"pid": 1234, "host": "h", "started": "2026-12-07 12:00:00 UTC", "command": "fsdpp run x.json"}' > "$corpus/holder"
  printf 'x' > "$corpus/garbage"
elif [[ $target == tokenizer ]]; then
  # A small model (300 pieces, 5 KB) trained here by the CLI: small inputs run many times faster
  # than the bundled 2048-piece model, and mutate into the same kinds of damage.
  seed_text=$out/tokenizer_seed_text
  mkdir -p "$seed_text"
  for i in 1 2; do cat "$src/docs/testing.md" "$src/docs/model.md" | tr -cd 'a-z \n' > "$seed_text/$i.txt"; done
  "$build/fsdpp" tokenizer train --vocab 300 "$seed_text" -o "$corpus/tiny.model" > /dev/null
elif [[ $target == tokenizer_json ]]; then
  # Small tokenizers of the two kinds published models use: byte-level BPE with a Split pattern,
  # NFC and added tokens; Metaspace BPE with byte fallback and its decoder sequence.
  python3 - "$corpus" <<'PY'
import json, sys
chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["\u0120", "\u010a"]
merges = [["h", "e"], ["t", "h"], ["th", "e"], ["\u0120", "t"], ["\u0120t", "he"], ["i", "n"]]
vocab = {c: i for i, c in enumerate(chars)}
for a, b in merges:
    vocab.setdefault(a + b, len(vocab))
added = [{"id": len(vocab), "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": False, "special": True},
         {"id": len(vocab) + 1, "content": "[DAY]", "single_word": True, "lstrip": True, "rstrip": True,
          "normalized": True, "special": False}]
byte_level = {"version": "1.0", "added_tokens": added, "normalizer": {"type": "NFC"},
              "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                  {"type": "Split", "pattern": {"Regex": "(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|\\s+(?!\\S)|\\s+"},
                   "behavior": "Isolated", "invert": False},
                  {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
              "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
              "model": {"type": "BPE", "ignore_merges": True, "vocab": vocab, "merges": merges}}
json.dump(byte_level, open(sys.argv[1] + "/byte_level.json", "w"))
pieces = ["<unk>", "\u2581", "\u2581t", "h", "e", "t"] + [f"<0x{b:02X}>" for b in range(256)]
meta = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False,
                                             "rstrip": False, "normalized": False, "special": True}],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                            {"type": "Replace", "pattern": {"String": " "},
                                                             "content": "\u2581"}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                                     {"type": "ByteFallback"}, {"type": "Fuse"},
                                                     {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                  "vocab": {p: i for i, p in enumerate(pieces)}, "merges": [["\u2581", "t"]]}}
json.dump(meta, open(sys.argv[1] + "/metaspace.json", "w"))
PY
elif [[ $target == chat ]]; then
  # Conversations (mode byte 0) as data.source "chat" reads them, and templates (mode byte 1).
  printf '\x00{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"prompt": "a", "completion": "b"}\n' > "$corpus/jsonl"
  printf '\x01{%%- set ns = namespace(n=0) -%%}{%% for m in messages %%}{%% set ns.n = ns.n + 1 %%}{{ m.role | upper }}: {%% if m.role == "assistant" %%}{%% generation %%}{{ m.content | trim }}{%% endgeneration %%}{%% else %%}{{ m["content"] }}{%% endif %%}\n{%% endfor %%}{{ ns.n }} {{ messages | length }} {{ messages[-1:] | tojson }}{%% if add_generation_prompt %%}A:{%% endif %%}' > "$corpus/template"
elif [[ $target == shards ]]; then
  # An index (mode byte 1) and a whole uint16 shard of 3 tokens (mode byte 0).
  printf '\x01{"format":"fsdpp.token_shards","version":1,"shards":[{"file":"tokens_train_000001.bin","split":"train","tokens":300}]}' > "$corpus/index"
  python3 - "$corpus/shard" <<'PY'
import struct, sys
with open(sys.argv[1], "wb") as f:
    f.write(b"\x00" + struct.pack("<256i", 20240520, 1, 3, *([0] * 253)) + struct.pack("<3H", 1, 2, 3))
PY
else
  # Valid files to mutate: a small safetensors file (mode byte 0) and a checkpoint index (mode 1).
  printf '\x00' > "$corpus/st"
  python3 - "$corpus/st" <<'PY'
import json, struct, sys
h = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                "b": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]}, "__metadata__": {"k": "v"}}).encode()
with open(sys.argv[1], "ab") as f:
    f.write(struct.pack("<Q", len(h)) + h + bytes(range(24)))
PY
  printf '\x01{"format":"fsdpp-sharded-2","world_size":1,"rank":0,"entries":[{"name":"w","shape":[4,3],"row_offset":0,"rows":4,"dtype":"Float"},{"name":"b","shape":[4],"row_offset":0,"rows":4,"dtype":"Float"}]}' > "$corpus/index"
fi
# Seconds per input are bounded so that a slow path counts as a finding too.
ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 "$bin" -artifact_prefix="$out/${target}_" -runs="$runs" -seed=1 -timeout=10 \
  -rss_limit_mb=4096 -max_len=65536 "$corpus" 2>&1 | tail -n 25
echo "fuzz: $target: $runs inputs without a finding"
