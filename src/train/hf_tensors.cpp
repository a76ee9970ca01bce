// The names and shapes of fsdpp's parameters in transformers' checkpoints, each family's
// (train/hf.hpp): export's views of fsdpp's tensors, import's tensors made from a checkpoint's.
#include "hf_tensors.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <map>
#include <stdexcept>

namespace fsdpp::train::hf {

namespace {

struct Names {
  std::string q, k, v, o, input_norm, post_norm;
};

Names attention_names(int64_t i) {
  const auto p = fmt::format("model.layers.{}.", i);
  return {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
          p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight",
          p + "input_layernorm.weight",  p + "post_attention_layernorm.weight"};
}

// A projection's bias beside its weight: model.layers.0.self_attn.q_proj.bias.
std::string bias_of(const std::string& weight) { return weight.substr(0, weight.size() - 6) + "bias"; }

// The fsdpp name of layer i's parameter `rest`.
std::string ours(int64_t i, const std::string& rest) { return fmt::format("layers.{}.{}", i, rest); }

const char* kMlp[3][2] = {{"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}};

// Every parameter of the model `c` describes (an unwrapped model, without expert parallelism), with
// its shape: what a file of full weights must hold.
std::map<std::string, std::vector<int64_t>> parameter_shapes(const models::MoEConfig& c) {
  const int64_t D = c.dim, hd = c.head_dim(), H = c.heads, KV = c.key_value_heads(), E = c.experts,
                F = c.expert_hidden, V = c.vocab_size;
  std::map<std::string, std::vector<int64_t>> shapes{{"embed.weight", {V, D}}, {"norm.weight", {D}}};
  if (!c.tie_embeddings) shapes["head.weight"] = {V, D};
  for (int64_t i = 0; i < c.layers; ++i) {
    shapes[ours(i, "attn_norm.weight")] = {D};
    shapes[ours(i, "ffn_norm.weight")] = {D};
    shapes[ours(i, "attn.qkv.weight")] = {(H + 2 * KV) * hd, D};
    if (c.qkv_bias) shapes[ours(i, "attn.qkv.bias")] = {(H + 2 * KV) * hd};
    if (c.qk_norm != "none") {
      const bool whole = c.qk_norm == "projection";
      shapes[ours(i, "attn.q_norm.weight")] = {whole ? H * hd : hd};
      shapes[ours(i, "attn.k_norm.weight")] = {whole ? KV * hd : hd};
    }
    shapes[ours(i, "attn.out.weight")] = {D, H * hd};
    if (c.is_moe_layer(i)) {
      shapes[ours(i, "moe.router.gate.weight")] = {E, D};
      shapes[ours(i, "moe.experts.w1")] = shapes[ours(i, "moe.experts.w3")] = {E, F, D};
      shapes[ours(i, "moe.experts.w2")] = {E, D, F};
      if (c.shared_expert) {
        const int64_t S = c.shared_expert_hidden > 0 ? c.shared_expert_hidden : F;
        shapes[ours(i, "moe.shared.w1.weight")] = shapes[ours(i, "moe.shared.w3.weight")] = {S, D};
        shapes[ours(i, "moe.shared.w2.weight")] = {D, S};
        if (c.shared_expert_gate) shapes[ours(i, "moe.shared_gate.weight")] = {1, D};
      }
    } else {
      shapes[ours(i, "mlp.w1.weight")] = shapes[ours(i, "mlp.w3.weight")] = {c.ffn_hidden, D};
      shapes[ours(i, "mlp.w2.weight")] = {D, c.ffn_hidden};
    }
  }
  return shapes;
}

}  // namespace

NamedTensors detail::to_hf_views(const models::MoEConfig& c, const NamedTensors& state) {
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  auto shapes = parameter_shapes(c);
  for (const auto& [name, t] : by_name) {
    const auto it = shapes.find(name);
    if (it == shapes.end())
      throw std::invalid_argument(
          fmt::format("export --format hf: {} is not a parameter of the model", name));
    if (t.sizes() != at::IntArrayRef(it->second))
      throw std::invalid_argument(
          fmt::format("export --format hf: {} has shape [{}], but the model config makes it [{}]", name,
                      fmt::join(t.sizes(), ", "), fmt::join(it->second, ", ")));
    if (!at::isFloatingType(t.scalar_type()))
      throw std::invalid_argument(fmt::format("export --format hf: {} is {}, not floating point", name,
                                              c10::toString(t.scalar_type())));
  }
  const auto get = [&](const std::string& name) {
    const auto it = by_name.find(name);
    if (it == by_name.end())
      throw std::invalid_argument(fmt::format("export --format hf: no parameter {}", name));
    return it->second;
  };
  NamedTensors out;
  const auto put = [&](std::string name, const at::Tensor& t) {
    out.emplace_back(std::move(name), t.detach());
  };
  put("model.embed_tokens.weight", get("embed.weight"));
  const int64_t hd = c.head_dim(), H = c.heads, KV = c.key_value_heads();
  const bool mixtral = export_type(c) == "mixtral";
  for (int64_t i = 0; i < c.layers; ++i) {
    const auto n = attention_names(i);
    const auto p = fmt::format("model.layers.{}.", i);
    put(n.input_norm, get(ours(i, "attn_norm.weight")));
    const auto qkv = get(ours(i, "attn.qkv.weight"));
    put(n.q, qkv.narrow(0, 0, H * hd));
    put(n.k, qkv.narrow(0, H * hd, KV * hd));
    put(n.v, qkv.narrow(0, (H + KV) * hd, KV * hd));
    if (c.qkv_bias) {  // Qwen2's
      const auto bias = get(ours(i, "attn.qkv.bias"));
      put(bias_of(n.q), bias.narrow(0, 0, H * hd));
      put(bias_of(n.k), bias.narrow(0, H * hd, KV * hd));
      put(bias_of(n.v), bias.narrow(0, (H + KV) * hd, KV * hd));
    }
    if (c.qk_norm != "none") {  // Qwen3's, OLMoE's
      put(p + "self_attn.q_norm.weight", get(ours(i, "attn.q_norm.weight")));
      put(p + "self_attn.k_norm.weight", get(ours(i, "attn.k_norm.weight")));
    }
    put(n.o, get(ours(i, "attn.out.weight")));
    put(n.post_norm, get(ours(i, "ffn_norm.weight")));
    if (c.is_moe_layer(i)) {
      const auto w1 = get(ours(i, "moe.experts.w1")), w2 = get(ours(i, "moe.experts.w2")),
                 w3 = get(ours(i, "moe.experts.w3"));
      // Mixtral's names, or Qwen3-MoE's and OLMoE's.
      const std::string block = mixtral ? "block_sparse_moe" : "mlp";
      const char* names[3] = {mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj",
                              mixtral ? "w2" : "down_proj"};
      put(p + block + ".gate.weight", get(ours(i, "moe.router.gate.weight")));
      for (int64_t e = 0; e < c.experts; ++e) {
        const auto ep = fmt::format("{}{}.experts.{}.", p, block, e);
        put(ep + names[0] + ".weight", w1[e]);
        put(ep + names[1] + ".weight", w3[e]);
        put(ep + names[2] + ".weight", w2[e]);
      }
      if (c.shared_expert_gate) {  // Qwen2-MoE's gated shared expert
        for (const auto& [mine, theirs] : kMlp)
          put(fmt::format("{}mlp.shared_expert.{}.weight", p, theirs),
              get(ours(i, fmt::format("moe.shared.{}.weight", mine))));
        put(p + "mlp.shared_expert_gate.weight", get(ours(i, "moe.shared_gate.weight")));
      }
    } else {
      for (const auto& [mine, theirs] : kMlp)
        put(fmt::format("{}mlp.{}.weight", p, theirs), get(ours(i, fmt::format("mlp.{}.weight", mine))));
    }
  }
  put("model.norm.weight", get("norm.weight"));
  if (!c.tie_embeddings) put("lm_head.weight", get("head.weight"));
  return out;
}

std::vector<LazyTensor> detail::from_hf_lazy(const models::MoEConfig& c, const NamedTensors& hf,
                                             const std::string& source) {
  std::map<std::string, at::Tensor> left(hf.begin(), hf.end());
  const auto has = [&](const std::string& name) { return left.count(name) > 0; };
  const auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    const auto it = left.find(name);
    if (it == left.end()) throw std::invalid_argument(fmt::format("{}: tensor {} is missing", source, name));
    auto t = it->second;
    if (t.sizes() != at::IntArrayRef(shape))
      throw std::invalid_argument(fmt::format("{}: {} has shape [{}], but config.json makes it [{}]", source,
                                              name, fmt::join(t.sizes(), ", "), fmt::join(shape, ", ")));
    if (!at::isFloatingType(t.scalar_type()))
      throw std::invalid_argument(
          fmt::format("{}: {} is {}, not floating point", source, name, c10::toString(t.scalar_type())));
    left.erase(it);
    return t;
  };
  const int64_t D = c.dim, hd = c.head_dim(), H = c.heads, KV = c.key_value_heads(), E = c.experts,
                F = c.expert_hidden;
  std::vector<LazyTensor> out;
  // A tensor of the checkpoint's as it is, and one made from several, for the rows asked for.
  const auto as_is = [&](std::string name, const at::Tensor& t) {
    out.push_back(lazy_view(std::move(name), t));
  };
  using Rows = std::function<at::Tensor(int64_t, int64_t)>;
  const auto joined = [&](std::string name, const std::vector<at::Tensor>& parts, std::vector<int64_t> shape,
                          Rows rows) {
    auto dtype = parts.front().scalar_type();
    for (const auto& t : parts) dtype = at::promote_types(dtype, t.scalar_type());
    out.push_back({std::move(name), dtype, std::move(shape), std::move(rows)});
  };
  // Rows of the parts laid one after another along dim 0 (the fused projection).
  const auto concatenated = [](std::vector<at::Tensor> parts) -> Rows {
    return [parts](int64_t first, int64_t count) {
      std::vector<at::Tensor> pieces;
      for (const auto& t : parts) {  // `first` counts from this part's first row
        const int64_t begin = std::max<int64_t>(first, 0), end = std::min(first + count, t.size(0));
        if (begin < end) pieces.push_back(t.narrow(0, begin, end - begin));
        first -= t.size(0);
      }
      return pieces.empty() ? parts.front().narrow(0, 0, 0) : at::cat(pieces, 0);
    };
  };
  // Rows of the parts stacked along a new dim 0 (one expert each).
  const auto stacked = [](std::vector<at::Tensor> parts) -> Rows {
    return [parts](int64_t first, int64_t count) {
      if (count == 0) {
        auto shape = parts.front().sizes().vec();
        shape.insert(shape.begin(), 0);
        return at::empty(shape, parts.front().options());
      }
      return at::stack(at::TensorList(parts).slice(first, count));
    };
  };
  as_is("embed.weight", take("model.embed_tokens.weight", {c.vocab_size, D}));
  for (int64_t i = 0; i < c.layers; ++i) {
    const auto n = attention_names(i);
    const auto p = fmt::format("model.layers.{}.", i);
    as_is(ours(i, "attn_norm.weight"), take(n.input_norm, {D}));
    const auto q = take(n.q, {H * hd, D}), k = take(n.k, {KV * hd, D}), v = take(n.v, {KV * hd, D});
    joined(ours(i, "attn.qkv.weight"), {q, k, v}, {(H + 2 * KV) * hd, D}, concatenated({q, k, v}));
    if (c.qkv_bias) {
      const auto qb = take(bias_of(n.q), {H * hd}), kb = take(bias_of(n.k), {KV * hd}),
                 vb = take(bias_of(n.v), {KV * hd});
      joined(ours(i, "attn.qkv.bias"), {qb, kb, vb}, {(H + 2 * KV) * hd}, concatenated({qb, kb, vb}));
    }
    if (c.qk_norm != "none") {
      const bool whole = c.qk_norm == "projection";
      as_is(ours(i, "attn.q_norm.weight"), take(p + "self_attn.q_norm.weight", {whole ? H * hd : hd}));
      as_is(ours(i, "attn.k_norm.weight"), take(p + "self_attn.k_norm.weight", {whole ? KV * hd : hd}));
    }
    as_is(ours(i, "attn.out.weight"), take(n.o, {D, H * hd}));
    as_is(ours(i, "ffn_norm.weight"), take(n.post_norm, {D}));
    // The router under `block`, and expert e's gate, up and down projections as `block`.experts.e.NAME.
    const auto per_expert = [&](const std::string& block, const char* gate, const char* up,
                                const char* down) {
      as_is(ours(i, "moe.router.gate.weight"), take(p + block + ".gate.weight", {E, D}));
      std::vector<at::Tensor> w1, w2, w3;
      for (int64_t e = 0; e < E; ++e) {
        const auto ep = fmt::format("{}{}.experts.{}.", p, block, e);
        w1.push_back(take(ep + gate + ".weight", {F, D}));
        w2.push_back(take(ep + down + ".weight", {D, F}));
        w3.push_back(take(ep + up + ".weight", {F, D}));
      }
      joined(ours(i, "moe.experts.w1"), w1, {E, F, D}, stacked(w1));
      joined(ours(i, "moe.experts.w3"), w3, {E, F, D}, stacked(w3));
      joined(ours(i, "moe.experts.w2"), w2, {E, D, F}, stacked(w2));
    };
    if (c.is_moe_layer(i)) {
      if (has(p + "block_sparse_moe.gate.weight")) {  // the layout save_pretrained writes for Mixtral
        per_expert("block_sparse_moe", "w1", "w3", "w2");
      } else if (has(p + "mlp.experts.0.gate_proj.weight")) {  // Qwen3-MoE's, OLMoE's and Qwen2-MoE's
        per_expert("mlp", "gate_proj", "up_proj", "down_proj");
      } else {  // transformers' in-memory layout: gate and up projections fused, experts stacked
        as_is(ours(i, "moe.router.gate.weight"), take(p + "mlp.gate.weight", {E, D}));
        const auto gate_up = take(p + "mlp.experts.gate_up_proj", {E, 2 * F, D});
        for (const int64_t half : {0, 1})  // gate (w1) rows first, then up (w3)
          joined(ours(i, half == 0 ? "moe.experts.w1" : "moe.experts.w3"), {gate_up}, {E, F, D},
                 [gate_up, F, half](int64_t first, int64_t count) {
                   return gate_up.narrow(0, first, count).narrow(1, half * F, F).contiguous();
                 });
        as_is(ours(i, "moe.experts.w2"), take(p + "mlp.experts.down_proj", {E, D, F}));
      }
      if (c.shared_expert_gate) {  // Qwen2-MoE's gated shared expert
        const int64_t S = c.shared_expert_hidden > 0 ? c.shared_expert_hidden : F;
        const auto sp = p + "mlp.shared_expert.";
        as_is(ours(i, "moe.shared.w1.weight"), take(sp + "gate_proj.weight", {S, D}));
        as_is(ours(i, "moe.shared.w3.weight"), take(sp + "up_proj.weight", {S, D}));
        as_is(ours(i, "moe.shared.w2.weight"), take(sp + "down_proj.weight", {D, S}));
        as_is(ours(i, "moe.shared_gate.weight"), take(p + "mlp.shared_expert_gate.weight", {1, D}));
      }
    } else {
      const int64_t Fd = c.ffn_hidden;
      as_is(ours(i, "mlp.w1.weight"), take(p + "mlp.gate_proj.weight", {Fd, D}));
      as_is(ours(i, "mlp.w3.weight"), take(p + "mlp.up_proj.weight", {Fd, D}));
      as_is(ours(i, "mlp.w2.weight"), take(p + "mlp.down_proj.weight", {D, Fd}));
    }
  }
  as_is("norm.weight", take("model.norm.weight", {D}));
  if (!c.tie_embeddings) {
    as_is("head.weight", take("lm_head.weight", {c.vocab_size, D}));
  } else if (has("lm_head.weight")) {
    // Some writers keep the tied head anyway; it must be the embedding.
    const auto head = take("lm_head.weight", {c.vocab_size, D});
    if (!at::equal(head, out.front().make()))
      throw std::invalid_argument(fmt::format(
          "{}: lm_head.weight differs from model.embed_tokens.weight, but tie_word_embeddings is true",
          source));
  }
  if (!left.empty()) {
    std::vector<std::string> names;
    for (const auto& [name, t] : left) names.push_back(name);
    throw std::invalid_argument(fmt::format("{}: {} tensor(s) that config.json has no place for: {}", source,
                                            names.size(), fmt::join(names, ", ")));
  }
  return out;
}

}  // namespace fsdpp::train::hf
