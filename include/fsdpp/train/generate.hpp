#pragma once
// Sampling text from a trained (unsharded) model: `fsdpp generate`.

#include <cstdint>
#include <string>

#include "fsdpp/models/moe.hpp"

namespace fsdpp::train {

struct SampleOptions {
  int64_t max_new_bytes = 200;
  double temperature = 0.8;  // 0: always the most likely byte
  int64_t top_k = 40;        // 0: all
  uint64_t seed = 0;
};

// Continues `prompt` byte by byte.
std::string generate(models::MoETransformerImpl& model, const std::string& prompt, const SampleOptions& options);

}  // namespace fsdpp::train
