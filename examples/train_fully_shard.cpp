// Shard your own model with fully_shard and train it on N ranks:
//   build/fsdpp launch --nproc 2 -- build/example_train_fully_shard
// Each rank holds 1/N of every parameter and of AdamW's state; the loss matches one-process training.
#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <iostream>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"

using namespace fsdpp;

// A residual MLP block; each becomes one sharding unit (one all-gather, one reduce-scatter).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) {
    up = register_module("up", torch::nn::Linear(dim, 4 * dim));
    down = register_module("down", torch::nn::Linear(4 * dim, dim));
  }
  at::Tensor forward(at::Tensor x) { return x + down(at::gelu(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t dim, int64_t depth) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(fsdp::FullyShard<Block>(Block(dim)));
    head = register_module("head", torch::nn::Linear(dim, 1));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : *blocks) x = b->as<fsdp::FullyShardImpl<Block>>()->forward(x);
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

int main() {
  auto comm = comm::init_from_env();  // torchrun-style environment, Gloo on CPU
  at::manual_seed(0);                 // same initial weights on every rank
  auto model = fsdp::fully_shard(Net(32, 4), comm);
  torch::optim::AdamW opt(model->sharded_parameters(), torch::optim::AdamWOptions(1e-3));

  // A regression target every rank can compute; each rank trains on its own slice of the batch.
  auto gen = at::detail::createCPUGenerator(1);
  const auto x = at::randn({64, 32}, gen), y = x.pow(2).sum(1, true).sqrt();
  const int64_t per_rank = 64 / comm.size();
  const auto mine = x.narrow(0, comm.rank() * per_rank, per_rank);
  const auto target = y.narrow(0, comm.rank() * per_rank, per_rank);

  for (int step = 1; step <= 200; ++step) {
    opt.zero_grad();
    auto loss = at::mse_loss(model->forward(mine), target);
    loss.backward();  // gradients are reduce-scattered, averaged over ranks, into the shards
    opt.step();
    auto global = loss.detach().clone();
    comm.all_reduce(global, {comm::ReduceOp::kAvg}).wait();
    if (comm.rank() == 0 && step % 50 == 0)
      std::cout << "step " << step << ": loss " << global.item<double>() << "\n";
  }
  if (comm.rank() == 0)
    std::cout << "parameters per rank: " << model->sharded_parameters().size() << " shards\n";
}
