#pragma once
// Full (unsharded) weights in and out of the MoE model: from a consolidated safetensors file, a
// checkpoint, or any safetensors file under the model's parameter names (model.init_from).

#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/lazy_tensor.hpp"

namespace fsdpp::fsdp {
class UnitHolder;
}

namespace fsdpp::train {

// Copies full weights (name, tensor) into the model's parameters, converting dtype. Throws naming
// `source` and the tensor when one is not a parameter, has another shape or is not floating point,
// or when a parameter is missing.
void load_full_weights(models::MoETransformerImpl& model,
                       const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const std::string& source);

// The same checks without copying: `weights` name for name and shape against the model's
// parameters (which need no storage: see Note [unallocated parameters]).
void check_full_weights(const models::MoETransformerImpl& model, const std::vector<LazyTensor>& weights,
                        const std::string& source);

// The weights of model.init_from, to be read by rows: a safetensors file under the model's
// parameter names (mapped into memory) or a transformers checkpoint directory (train/hf.hpp).
std::vector<LazyTensor> read_weights_by_rows(const std::string& path);

// Sets this rank's shard of every parameter under `root` (a model or stage sharded by fully_shard)
// from `weights`, checked beforehand by check_full_weights: each rank reads only the rows it
// keeps, so a model larger than one rank's memory loads. Throws naming `source` and the parameter
// when `weights` has no tensor for it.
void load_shards(fsdp::UnitHolder& root, const std::vector<LazyTensor>& weights, const std::string& source);

// An unsharded model with the weights of a checkpoint directory, an output directory, a
// consolidated safetensors file or a transformers checkpoint directory (train/hf.hpp). `tokenizer`,
// when given, receives the tokenizer the weights were trained with, as Tokenizer::identity()
// recorded it ("bytes" for files that predate the record; null for a transformers directory whose
// tokenizer is not the bytes tokenizer).
models::MoETransformer load_model(const std::string& path, nlohmann::json* tokenizer = nullptr);

// What load_model reads, without building the model: the config, the full weights under the
// model's names (a consolidated or transformers file's are views of the file mapped into memory,
// read as they are touched) and the tokenizer record (as load_model describes it).
struct FullWeights {
  models::MoEConfig config;
  std::vector<std::pair<std::string, at::Tensor>> state;
  nlohmann::json tokenizer;
};
FullWeights read_full_weights(const std::string& path);

}  // namespace fsdpp::train
