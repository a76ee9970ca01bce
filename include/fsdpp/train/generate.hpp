#pragma once
// Sampling text from a trained (unsharded) model: `fsdpp generate`.

#include <cstdint>
#include <string>

#include "fsdpp/models/moe.hpp"

namespace fsdpp::train {

class Tokenizer;

struct SampleOptions {
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0: always the most likely token
  int64_t top_k = 40;        // 0: all
  uint64_t seed = 0;
};

// Continues `prompt` token by token, stopping early at the tokenizer's end-of-text token; returns
// the decoded continuation. Throws std::invalid_argument when the tokenizer's vocabulary is not
// the model's.
std::string generate(models::MoETransformerImpl& model, const Tokenizer& tokenizer, const std::string& prompt,
                     const SampleOptions& options);

}  // namespace fsdpp::train
