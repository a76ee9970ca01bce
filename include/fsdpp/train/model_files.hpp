#pragma once
// Full (unsharded) weights in and out of the MoE model: from a consolidated safetensors file, a
// checkpoint, or any safetensors file under the model's parameter names (model.init_from).

#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "fsdpp/models/moe.hpp"

namespace fsdpp::train {

// Copies full weights (name, tensor) into the model's parameters, converting dtype. Throws naming
// `source` and the tensor when one is not a parameter, has another shape or is not floating point,
// or when a parameter is missing.
void load_full_weights(models::MoETransformerImpl& model,
                       const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const std::string& source);

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
