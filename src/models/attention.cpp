// The model's attention module (models/moe.hpp's AttentionImpl): the projection with its bias and
// q/k norms, the rotary tables with their scaling, packed samples and the sliding window as per-row
// key starts, and the kernels of models/cpu/kernels.hpp.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

#include "fsdpp/models/cpu/kernels.hpp"
#include "fsdpp/models/cpu/matmul.hpp"
#include "fsdpp/models/moe.hpp"
#include "init_weights.hpp"

namespace fsdpp::models {

using detail::building_unallocated;
using detail::init_normal;

AttentionImpl::AttentionImpl(const MoEConfig& c)
    : heads(c.heads),
      kv_heads(c.key_value_heads()),
      head_dim(c.head_dim()),
      sliding_window(c.sliding_window),
      rope{.theta = c.rope_theta,
           .type = c.rope_type,
           .factor = c.rope_factor,
           .low_freq_factor = c.rope_low_freq_factor,
           .high_freq_factor = c.rope_high_freq_factor,
           .original_max_seq_len = c.rope_original_max_seq_len},
      own_products(c.own_products),
      fused(c.fused_kernels && c.fused_attention) {
  // Rows: the query heads', then the key heads', then the value heads'.
  qkv = register_module(
      "qkv",
      torch::nn::Linear(torch::nn::LinearOptions(c.dim, (heads + 2 * kv_heads) * head_dim).bias(c.qkv_bias)));
  out = register_module("out",
                        torch::nn::Linear(torch::nn::LinearOptions(heads * head_dim, c.dim).bias(false)));
  if (c.qk_norm != "none") {
    const bool whole = c.qk_norm == "projection";
    q_norm =
        register_module("q_norm", RMSNorm(whole ? heads * head_dim : head_dim, c.norm_eps, c.fused_kernels));
    k_norm = register_module("k_norm",
                             RMSNorm(whole ? kv_heads * head_dim : head_dim, c.norm_eps, c.fused_kernels));
    norm_whole_projection = whole;
  }
  init_normal(qkv->weight, c.init_std);
  if (c.qkv_bias && !building_unallocated) {
    at::NoGradGuard no_grad;
    qkv->bias.zero_();
  }
  init_normal(out->weight, c.init_std / std::sqrt(2.0 * double(c.layers)));
}

const std::pair<at::Tensor, at::Tensor>& AttentionImpl::rope_tables(int64_t T, int64_t hd,
                                                                    const at::Tensor& like) {
  const auto& cos = tables_.first;
  if (cos.defined() && cos.size(0) == T && cos.size(1) == hd && cos.scalar_type() == like.scalar_type() &&
      cos.device() == like.device())
    return tables_;
  tables_ = rotary_tables(T, hd, rope, like.options());
  return tables_;
}

at::Tensor AttentionImpl::project(const at::Tensor& x) {
  const auto B = x.size(0), T = x.size(1);
  auto p = linear(x, qkv->weight, own_route(own_products, x));
  if (qkv->bias.defined()) p = p + qkv->bias;
  p = p.view({B, T, heads + 2 * kv_heads, head_dim});
  if (!q_norm) return p;
  if (norm_whole_projection) {  // OLMoE's: over all of a token's queries, and all its keys
    const auto flat = [&](int64_t first, int64_t n) {
      return p.narrow(2, first, n).reshape({B, T, n * head_dim});
    };
    return at::cat({q_norm(flat(0, heads)).view({B, T, heads, head_dim}),
                    k_norm(flat(heads, kv_heads)).view({B, T, kv_heads, head_dim}),
                    p.narrow(2, heads + kv_heads, kv_heads)},
                   2);
  }
  // Qwen3's norms: over each query head and each key head, before the rotary embedding.
  return at::cat({q_norm(p.narrow(2, 0, heads).contiguous()),
                  k_norm(p.narrow(2, heads, kv_heads).contiguous()), p.narrow(2, heads + kv_heads, kv_heads)},
                 2);
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& positions) {
  const auto B = x.size(0), T = x.size(1), hd = head_dim;
  // Packed samples: each token rotated at its own sequence's position, attending within it.
  const bool packed = positions.defined();
  const auto tables = packed ? rotary_at(rope_tables(T, hd, x), positions) : rope_tables(T, hd, x);
  const auto& [cos, sin] = tables;
  at::Tensor starts = packed ? sequence_starts(positions) : at::Tensor();
  if (sliding_window > 0 && T > sliding_window) {
    // Each query's first key at most sliding_window - 1 positions back.
    const auto window =
        (at::arange(T, x.options().dtype(at::kLong)) - (sliding_window - 1)).clamp_min(0).unsqueeze(0);
    starts = packed ? at::maximum(starts, window) : window.expand({B, T}).contiguous();
  }
  auto projected = project(x);
  if (kv_heads == heads) {
    projected = projected.view({B, T, 3, heads, hd});
  } else {
    // Grouped-query attention: each key and value head repeated for the query heads it serves
    // (consecutive ones), so that the attention below sees one per query head.
    const auto p = projected;
    const auto group = heads / kv_heads;
    projected = at::stack({p.narrow(2, 0, heads), p.narrow(2, heads, kv_heads).repeat_interleave(group, 2),
                           p.narrow(2, heads + kv_heads, kv_heads).repeat_interleave(group, 2)},
                          2);
  }
  // Rotary embedding and causal softmax(q k^T / sqrt(hd)) v: with fused kernels in one pass per
  // head (models::rotary_causal_attention on the CPU), else rotary_qkv and the attention the backend
  // scaled_dot_product_attention picks (flash attention on the CPU). No [B, H, T, T] score tensor
  // is materialised, forward or backward, unmasked. The result is laid out [B, T, H, hd] in memory,
  // so the reshape below is a view.
  at::Tensor y;
  if (fused) {
    y = rotary_causal_attention(projected, cos, sin, starts);
  } else {
    const auto [q, k, v] = rotary_qkv(projected, cos, sin);  // [B, H, T, hd] each
    y = causal_attention_reference(q, k, v, starts);
  }
  return linear(y.transpose(1, 2).reshape({B, T, heads * hd}), out->weight, own_route(own_products, x));
}

}  // namespace fsdpp::models
