#pragma once
// Hugging Face transformers checkpoints in and out (`fsdpp export --format hf`, `fsdpp import`,
// model.init_from naming a transformers directory). docs/checkpoints.md has the mapping.
//
// Dense configs are LlamaForCausalLM; configs whose every layer is MoE, with softmax routing to
// top-k > 1 experts whose weights are renormalised and no shared expert, are MixtralForCausalLM.
// Anything else no transformers class computes exactly is refused, naming the config key.
//
// Parameters map one to one, except the attention's fused projection, whose rows are the query
// heads', then the key heads', then the value heads' (q_proj, k_proj, v_proj in that order), and
// the stacked experts ([E, ...] tensors), which Mixtral keeps one per expert
// (block_sparse_moe.experts.<e>.w1/w2/w3). Rotary embeddings rotate halves in both, so no
// permutation of rows is needed.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdpp/models/config.hpp"
#include "fsdpp/train/lazy_tensor.hpp"

namespace fsdpp::train {

class Tokenizer;

namespace hf {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Whether `path` is a directory holding a transformers config.json.
bool is_checkpoint_dir(const std::string& path);

// The transformers config.json for `c` with weights in `dtype`. Throws std::invalid_argument naming
// the model key (model.score, model.dense_layers ...) when no transformers class expresses `c`
// exactly.
nlohmann::json export_config(const models::MoEConfig& c, at::ScalarType dtype);
// The model_type export writes for `c`: qwen3, qwen2, mistral or llama (dense), qwen3_moe, olmoe or
// mixtral (MoE), by its q/k norms, biases and sliding window (export_config refuses the rest).
std::string export_type(const models::MoEConfig& c);

// The model config of a transformers config.json (`source` names it in messages). Throws
// std::invalid_argument naming the field and its value when fsdpp does not implement it (another
// model_type than docs/checkpoints.md lists, other rope types, biases on other projections ...).
models::MoEConfig import_config(const nlohmann::json& config, const std::string& source);

// The config.json field that holds fsdpp's model key `key` for a model with (`moe`) or without
// experts ("dim" -> "hidden_size", "ffn_hidden" -> "intermediate_size" ...); empty for a key that
// such a checkpoint does not determine (a Llama's experts' settings, a Mixtral's dense width).
std::string field_of(const std::string& key, bool moe);

struct ExportOptions {
  std::optional<at::ScalarType> dtype;        // unset: the parameters' own
  uint64_t max_shard_bytes = 50'000'000'000;  // transformers' default: one file up to 50 GB
};

// Writes `dir` (which must not exist) as transformers' save_pretrained does: config.json,
// generation_config.json, model.safetensors or model-0000i-of-0000n.safetensors with
// model.safetensors.index.json, and, for the bytes tokenizer, tokenizer.json and
// tokenizer_config.json. Written under a temporary name and renamed when whole: on any failure
// nothing is left. Returns the files written.
std::vector<std::string> export_checkpoint(const models::MoEConfig& c, const NamedTensors& state,
                                           const Tokenizer* tokenizer, const std::string& dir,
                                           const ExportOptions& options = {});

struct Imported {
  models::MoEConfig config;
  NamedTensors state;  // fsdpp's names
  // {"spec": "bytes", ...} when the directory's tokenizer is the bytes tokenizer as exported here;
  // null otherwise.
  nlohmann::json tokenizer;
};

// Reads a transformers checkpoint directory (config.json, model.safetensors or an index and its
// shards, mapped into memory). Throws std::invalid_argument / std::runtime_error naming the file
// and what is wrong.
Imported import_checkpoint(const std::string& dir);

// The same with fsdpp's tensors made when asked for, whole or by rows (train/lazy_tensor.hpp):
// `fsdpp import` writes each before the next is made, and a run's ranks read only their shards'
// rows.
struct LazyImport {
  models::MoEConfig config;
  std::vector<LazyTensor> tensors;
  nlohmann::json tokenizer;    // null where the directory holds none that fsdpp reads
  std::string tokenizer_note;  // then why, where it holds one ("no tokenizer taken: ...")
};
LazyImport import_checkpoint_lazy(const std::string& dir);

}  // namespace hf
}  // namespace fsdpp::train
