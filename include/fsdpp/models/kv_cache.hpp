#pragma once
// Incremental decoding for sampling: each layer's rotated keys and values of the tokens so far, so
// that a new token costs its own projections and one row of attention per layer instead of a
// forward over the whole sequence (bench/results/generate.md).
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "fsdpp/models/moe.hpp"

namespace fsdpp::models {

class KVCache {
 public:
  // For a whole model (embedding, every layer, head), up to its max_seq_len positions, for `batch`
  // sequences decoded together.
  explicit KVCache(MoETransformerImpl& model, int64_t batch = 1);

  // Positions held so far, and how many it can hold.
  int64_t size() const { return size_; }
  int64_t capacity() const { return capacity_; }

  // Logits [B, t, vocab] (float32) of `tokens` [B, t] (int64) at positions size() to size() + t - 1,
  // each attending to every earlier position and itself (the last sliding_window with one), as
  // MoETransformerImpl::forward would over the whole sequence; their keys and values are kept. Throws std::invalid_argument past
  // capacity(). Call under at::NoGradGuard.
  at::Tensor forward(const at::Tensor& tokens);

  void clear() { size_ = 0; }

 private:
  at::Tensor attend(AttentionImpl& attn, const at::Tensor& h, size_t layer);

  MoETransformerImpl& model_;
  int64_t capacity_, size_ = 0;
  std::vector<at::Tensor> keys_, values_;  // per layer [B, kv_heads, capacity, head_dim]
  at::Tensor cos_, sin_;                   // [capacity, head_dim]
};

}  // namespace fsdpp::models
