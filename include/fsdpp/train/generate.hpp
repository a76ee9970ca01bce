#pragma once
// Sampling text from a trained (unsharded) model: `fsdpp generate`.

#include <cstdint>
#include <string>
#include <vector>

#include "fsdpp/models/moe.hpp"

namespace fsdpp::train {

class Tokenizer;

struct SampleOptions {
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0: always the most likely token
  int64_t top_k = 40;        // 0: all
  double top_p = 1;          // nucleus: the fewest likeliest tokens whose probability reaches it (1: all)
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;  // ids that end the continuation, besides the end-of-text token
  // Keys and values kept per layer (models::KVCache), so that each new token costs the same
  // whatever came before it, up to max_seq_len; past it the window slides and is recomputed.
  bool kv_cache = true;
};

// Continues `prompt` token by token, stopping early at the tokenizer's end-of-text token or a stop
// id; returns the decoded continuation. Throws std::invalid_argument when the tokenizer does not fit
// the model (Tokenizer::fits_model) or an option is out of range.
std::string generate(models::MoETransformerImpl& model, const Tokenizer& tokenizer, const std::string& prompt,
                     const SampleOptions& options);

}  // namespace fsdpp::train
