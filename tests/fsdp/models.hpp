#pragma once
// Small models for the fully_shard tests, written the way a user would: blocks declared as
// fsdp::FullyShard<Block> members (unsharded until fully_shard is called, so the same class is
// also the plain LibTorch reference).
#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "comm/ranks.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"

namespace fsdpp::test {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) {
    fc1 = register_module("fc1", torch::nn::Linear(d, 2 * d));
    fc2 = register_module("fc2", torch::nn::Linear(2 * d, d));
    norm_weight = register_parameter("norm_weight", at::ones({d}));
  }
  // The norm weight may be kept in float32 inside a bfloat16 model; compute returns to x's dtype.
  at::Tensor forward(at::Tensor x) { return x + fc2(at::tanh(fc1((x * norm_weight).to(x.scalar_type())))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor norm_weight;
};
TORCH_MODULE(Block);

// in: [B, 5] -> d -> blocks -> [B, 3]. 5 and 3 rows do not divide evenly over 2, 3 or 4 ranks.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int layers) {
    inp = register_module("inp", torch::nn::Linear(5, d));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < layers; ++i) blocks->push_back(fsdp::FullyShard<Block>(Block(d)));
    head = register_module("head", torch::nn::Linear(d, 3));
  }
  at::Tensor forward(at::Tensor x) {
    auto h = inp(x);
    for (auto& b : *blocks) h = b->as<fsdp::FullyShardImpl<Block>>()->forward(h);
    return head(h);
  }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

// Copies every parameter of `from` into `to` (same class), by name.
inline void copy_params(torch::nn::Module& to, torch::nn::Module& from) {
  at::NoGradGuard no_grad;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(src[p.key()]);
}

// ||a - b|| / ||b||: relative error of a whole tensor, so that one element near zero does not
// dominate.
inline double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const auto bd = b.to(at::kDouble);
  return (a.to(at::kDouble) - bd).norm().item<double>() / (bd.norm().item<double>() + 1e-30);
}

}  // namespace fsdpp::test
