#pragma once
// A small decoder-only transformer (pre-norm, causal attention, GELU MLP) for benchmarks, written as
// a user would: blocks as fsdp::FullyShard<Block> members.
#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>

#include "fsdpp/fsdp/fully_shard.hpp"

namespace fsdpp::bench {

struct TransformerConfig {
  int64_t vocab = 256, dim = 128, heads = 4, layers = 4, seq = 64;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const TransformerConfig& c) : heads(c.heads) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    qkv = register_module("qkv", torch::nn::Linear(c.dim, 3 * c.dim));
    proj = register_module("proj", torch::nn::Linear(c.dim, c.dim));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    up = register_module("up", torch::nn::Linear(c.dim, 4 * c.dim));
    down = register_module("down", torch::nn::Linear(4 * c.dim, c.dim));
  }
  at::Tensor forward(at::Tensor x) {
    const auto B = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads;
    auto q_k_v = qkv(norm1(x)).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    auto att = at::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(double(hd));
    auto mask = at::ones({T, T}, at::kBool).triu(1);
    att = att.masked_fill(mask, -1e9).softmax(-1);
    auto y = at::matmul(att, q_k_v[2]).transpose(1, 2).reshape({B, T, D});
    x = x + proj(y);
    return x + down(at::gelu(up(norm2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct TransformerImpl : torch::nn::Module {
  explicit TransformerImpl(const TransformerConfig& c) {
    embed = register_module("embed", torch::nn::Embedding(c.vocab, c.dim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(fsdp::FullyShard<Block>(Block(c)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    head = register_module("head", torch::nn::Linear(c.dim, c.vocab));
  }
  at::Tensor forward(at::Tensor tokens) {
    auto h = embed(tokens);
    for (auto& b : *blocks) h = b->as<fsdp::FullyShardImpl<Block>>()->forward(h);
    return head(norm(h));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Transformer);

}  // namespace fsdpp::bench
