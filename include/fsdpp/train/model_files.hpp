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

// An unsharded model with the weights of a checkpoint directory, an output directory or a
// consolidated safetensors file. `tokenizer`, when given, receives the tokenizer the weights were
// trained with, as Tokenizer::identity() recorded it ("bytes" for files that predate the record).
models::MoETransformer load_model(const std::string& path, nlohmann::json* tokenizer = nullptr);

}  // namespace fsdpp::train
