// Activation checkpointing: a checkpointed block recomputes its forward in backward, and training
// is the same with it as without, alone and inside fully_shard units over 2 ranks.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <mutex>
#include <vector>

#include "comm/ranks.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/activation_checkpoint.hpp"
#include "fsdpp/train/sharding.hpp"

using namespace fsdpp;

namespace {

models::MoEConfig config() {
  models::MoEConfig c;
  c.dim = 32, c.heads = 2, c.layers = 4, c.max_seq_len = 32, c.ffn_hidden = 64, c.dense_layers = 1;
  c.experts = 4, c.top_k = 2, c.expert_hidden = 32;
  return c;
}

models::MoETransformer seeded_model() {
  at::manual_seed(21);
  return models::MoETransformer(config());
}

at::Tensor tokens(uint64_t seed, int64_t rows) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(256, {rows, 17}, gen);
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / (b.abs().max() + 1e-30)).item<double>();
}

}  // namespace

TEST_CASE("activation checkpointing: the chosen blocks recompute in backward; loss and gradients unchanged") {
  const auto data = tokens(3, 4);
  const auto x = data.narrow(1, 0, 16), y = data.narrow(1, 1, 16);
  auto plain = seeded_model();
  const auto want_loss = models::lm_loss(plain->forward(x), y);
  want_loss.backward();
  for (int64_t every : {1, 2, 3}) {
    CAPTURE(every);
    auto model = seeded_model();
    std::vector<train::Checkpoint> wrappers;
    model->wrap_blocks([&](const models::Block& block, int64_t layer) {
      if (!train::checkpoints_layer(every, layer)) return torch::nn::AnyModule(block);
      wrappers.push_back(train::Checkpoint(torch::nn::AnyModule(block)));
      return torch::nn::AnyModule(wrappers.back());
    });
    CHECK(wrappers.size() == size_t((config().layers + every - 1) / every));
    const auto loss = models::lm_loss(model->forward(x), y);
    for (auto& w : wrappers) CHECK(w->recomputes() == 0);  // forward keeps nothing to recompute from yet
    loss.backward();
    for (auto& w : wrappers) CHECK(w->recomputes() == 1);
    CHECK(loss.item<double>() == doctest::Approx(want_loss.item<double>()).epsilon(1e-7));
    const auto want = plain->named_parameters();
    for (const auto& p : model->named_parameters()) {
      CAPTURE(p.key());
      REQUIRE(p.value().grad().defined());
      CHECK(max_rel(p.value().grad(), want[p.key()].grad()) < 1e-5);
    }
  }
}

TEST_CASE("activation checkpointing inside fully_shard units: 3 AdamW steps as without it, at world 2") {
  auto run = [](int64_t every) {
    std::vector<std::vector<double>> losses(2);
    std::vector<std::vector<at::Tensor>> params(2);
    test::run_ranks(2, [&](comm::Comm& comm) {
      const int r = comm.rank();
      models::MoETransformer model(nullptr);
      {
        static std::mutex seeding;  // the global generator is not for threads
        std::lock_guard<std::mutex> lock(seeding);
        model = seeded_model();
      }
      auto root = train::shard_model(model, comm, {}, every);
      fsdp::AdamW opt(root->sharded_parameters(), {.lr = 1e-2});
      for (int step = 0; step < 3; ++step) {
        const auto data = tokens(10 * step + r, 2);
        opt.zero_grad();
        const auto loss = models::lm_loss(root->forward(data.narrow(1, 0, 16)), data.narrow(1, 1, 16));
        loss.backward();
        opt.step();
        losses[r].push_back(loss.item<double>());
      }
      for (auto& p : root->sharded_parameters()) params[r].push_back(p.detach().clone());
      // Each block's unit holds its checkpoint wrapper, which recomputed once per step.
      int wrapped = 0;
      for (const auto& child : root->inner().layers->named_children())
        if (auto unit =
                std::dynamic_pointer_cast<fsdp::FullyShardImpl<train::CheckpointImpl>>(child.value())) {
          ++wrapped;
          CHECK(unit->inner().recomputes() == 3);
        }
      CHECK(wrapped == (every > 0 ? config().layers : 0));
    });
    return std::make_pair(losses, params);
  };
  const auto [want_losses, want_params] = run(0);
  const auto [got_losses, got_params] = run(1);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    for (size_t s = 0; s < want_losses[r].size(); ++s)
      CHECK(got_losses[r][s] == doctest::Approx(want_losses[r][s]).epsilon(1e-6));
    REQUIRE(got_params[r].size() == want_params[r].size());
    for (size_t i = 0; i < want_params[r].size(); ++i)
      if (want_params[r][i].numel() > 0) CHECK(max_rel(got_params[r][i], want_params[r][i]) < 1e-5);
  }
}
