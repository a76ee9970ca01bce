#include "fsdpp/models/kv_cache.hpp"

#include <fmt/format.h>

#include <optional>
#include <stdexcept>

#include "fsdpp/models/cpu/kernels.hpp"
#include "fsdpp/models/cpu/matmul.hpp"

namespace fsdpp::models {

KVCache::KVCache(MoETransformerImpl& model, int64_t batch)
    : model_(model), capacity_(model.config().max_seq_len) {
  if (!model.has_embedding() || !model.has_head())
    throw std::invalid_argument("KVCache: needs the whole model (embedding, every layer, head), not a stage");
  const auto& first = model.blocks().front().ptr()->attn;
  const int64_t hd = first->head_dim, kv = first->kv_heads;
  const auto options = first->qkv->weight.options();
  for (size_t l = 0; l < model.blocks().size(); ++l) {
    keys_.push_back(at::empty({batch, kv, capacity_, hd}, options));
    values_.push_back(at::empty({batch, kv, capacity_, hd}, options));
  }
  std::tie(cos_, sin_) = rotary_tables(capacity_, hd, first->rope, options);
}

at::Tensor KVCache::attend(AttentionImpl& attn, const at::Tensor& h, size_t layer) {
  const auto B = h.size(0), t = h.size(1), H = attn.heads, kv = attn.kv_heads, hd = attn.head_dim;
  const bool own = own_route(attn.own_products, h);
  // [B, t, H + 2 kv, hd]: the query heads, then the key heads, then the value heads (as the fused
  // projection lays them out; with kv == H the same order).
  const auto p = attn.project(h);
  const auto cos = cos_.narrow(0, size_, t), sin = sin_.narrow(0, size_, t);
  const auto q = rotary_reference(p.narrow(2, 0, H).transpose(1, 2), cos, sin);
  keys_[layer].narrow(2, size_, t).copy_(rotary_reference(p.narrow(2, H, kv).transpose(1, 2), cos, sin));
  values_[layer].narrow(2, size_, t).copy_(p.narrow(2, H + kv, kv).transpose(1, 2));
  const auto k = keys_[layer].narrow(2, 0, size_ + t), v = values_[layer].narrow(2, 0, size_ + t);
  // New query i (position size_ + i) sees keys 0 .. size_ + i, the last sliding_window of them with
  // a window.
  std::optional<at::Tensor> mask;
  const int64_t W = attn.sliding_window;
  if (t > 1 || (W > 0 && size_ + t > W)) {
    const auto long_options = h.options().dtype(at::kLong);
    const auto query = at::arange(size_, size_ + t, long_options).unsqueeze(1),
               key = at::arange(size_ + t, long_options);
    mask = key <= query;
    if (W > 0) *mask = *mask & (key > query - W);
  }
  // Query head h reads key and value head h / (H / kv) (enable_gqa), with no copy of the cache.
  const auto y = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, std::nullopt,
                                                  /*enable_gqa=*/kv != H);  // [B, H, t, hd]
  return linear(y.transpose(1, 2).reshape({B, t, H * hd}), attn.out->weight, own);
}

at::Tensor KVCache::forward(const at::Tensor& tokens) {
  const int64_t t = tokens.size(1);
  if (size_ + t > capacity_)
    throw std::invalid_argument(
        fmt::format("KVCache: {} positions held and {} more would pass max_seq_len {}", size_, t, capacity_));
  at::Tensor x = model_.embed(tokens);
  const auto& blocks = model_.blocks();
  for (size_t l = 0; l < blocks.size(); ++l) {
    BlockImpl& b = *blocks[l].ptr();
    const auto [x0, h0] = b.attn_norm->forward_residual(x, at::Tensor());
    const auto [x1, h1] = b.ffn_norm->forward_residual(x0, attend(*b.attn, h0, l));
    x = x1 + (b.moe ? b.moe(h1) : b.mlp(h1));
  }
  size_ += t;
  const auto normed = model_.norm(x);
  return linear(normed, model_.output_weight(), own_route(model_.config().own_products, normed))
      .to(at::kFloat);
}

}  // namespace fsdpp::models
