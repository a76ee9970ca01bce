// Expert parallelism in the MoE layer: ranks as threads over real Gloo, each with its own batch,
// against one unsharded layer run on every rank's batch in turn. Outputs, input gradients and
// router gradients must match per rank; a rank's expert gradients must be the sum over the ranks
// of the reference's gradients of those experts (every sender's tokens reach them).
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <map>
#include <mutex>

#include "comm/ranks.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/sharding.hpp"

using namespace fsdpp;
using models::MoEConfig;

namespace {

MoEConfig ep_config(const std::string& routing, int64_t experts) {
  MoEConfig c;
  c.dim = 16;
  c.experts = experts;
  c.top_k = 2;
  c.expert_hidden = 12;
  c.shared_expert = true;
  c.routing = routing;
  c.capacity_factor = 1.0;  // capacity: some assignments drop, decided per rank as without ep
  return c;
}

// Ranks are threads sharing the default generator: seeded draws take turns.
std::mutex g_rng;

models::MoE make_moe(const MoEConfig& c) {
  std::lock_guard<std::mutex> lock(g_rng);
  at::manual_seed(7);
  return models::MoE(c, std::make_shared<models::RouterStats>());
}

struct Result {
  at::Tensor out, input_grad;
  std::map<std::string, at::Tensor> grads;
  double dropped = 0;
};

Result run(models::MoE& moe, const at::Tensor& input) {
  auto x = input.clone().requires_grad_(true);
  for (auto& p : moe->parameters()) p.mutable_grad() = at::Tensor();
  moe->stats->reset();
  auto y = moe->forward(x);
  (y * y).sum().backward();
  Result r{y.detach(), x.grad(), {}, double(moe->stats->read().dropped)};
  for (auto& p : moe->named_parameters())
    r.grads[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : at::zeros_like(p.value());
  return r;
}

// Each rank's batch; `skewed` makes every token choose experts 0 and 1 (positive inputs, gate rows
// +1 for them and -1 for the rest), so that the other ranks' experts receive nothing.
at::Tensor batch(int rank, const MoEConfig& c, bool skewed) {
  std::lock_guard<std::mutex> lock(g_rng);
  at::manual_seed(100 + rank);
  // Dropless: the ranks route different numbers of tokens. Capacity exchanges fixed-size slot
  // buffers, so every rank routes as many.
  auto x = at::randn({2, c.routing == "dropless" ? 5 + rank : 6, c.dim});
  return skewed ? x.abs() + 0.1 : x;
}

void skew(models::MoE& moe) {
  std::lock_guard<std::mutex> lock(g_rng);
  at::manual_seed(11);
  at::NoGradGuard g;
  auto& w = moe->router->gate->weight;
  w.fill_(-1.0);
  w.narrow(0, 0, 2).fill_(1.0);
  w.add_(at::randn(w.sizes()) * 0.01);
}

void check_against_reference(int ranks, const std::string& routing, bool skewed) {
  const auto c = ep_config(routing, 8);
  test::run_ranks(ranks, [&](comm::Comm& comm) {
    auto reference = make_moe(c);
    if (skewed) skew(reference);
    std::vector<Result> want;
    for (int r = 0; r < ranks; ++r) want.push_back(run(reference, batch(r, c, skewed)));

    auto moe = make_moe(c);
    if (skewed) skew(moe);
    moe->set_expert_parallel(train::token_exchange(comm));
    const int64_t local = c.experts / ranks, first = comm.rank() * local;
    CHECK(moe->experts->w1.size(0) == local);
    const auto got = run(moe, batch(comm.rank(), c, skewed));
    const auto& mine = want[size_t(comm.rank())];
    CHECK(got.out.allclose(mine.out, 1e-5, 1e-6));
    CHECK(got.input_grad.allclose(mine.input_grad, 1e-4, 1e-6));
    CHECK(got.dropped == mine.dropped);
    for (const auto& [name, g] : got.grads) {
      CAPTURE(name);
      if (name.rfind("experts.", 0) == 0) {
        auto sum = at::zeros_like(g);
        for (const auto& w : want) sum += w.grads.at(name).narrow(0, first, local);
        CHECK(g.allclose(sum, 1e-4, 1e-6));
        if (skewed && first >= 2) CHECK(g.abs().max().item<double>() == 0.0);  // no tokens came
      } else {
        CHECK(g.allclose(mine.grads.at(name), 1e-4, 1e-6));
      }
    }
    // Evaluation (no autograd) exchanges the same way.
    at::NoGradGuard g;
    CHECK(moe->forward(batch(comm.rank(), c, skewed)).allclose(mine.out, 1e-5, 1e-6));
  });
}

}  // namespace

TEST_CASE(
    "expert parallelism: each rank's outputs and gradients are the unsharded layer's, dropless and "
    "capacity") {
  for (const int ranks : {2, 4})
    for (const std::string routing : {"dropless", "capacity"}) {
      CAPTURE(ranks);
      CAPTURE(routing);
      check_against_reference(ranks, routing, /*skewed=*/false);
    }
}

TEST_CASE("expert parallelism: experts that receive no tokens neither hang nor change the results") {
  for (const std::string routing : {"dropless", "capacity"}) {
    CAPTURE(routing);
    check_against_reference(4, routing, /*skewed=*/true);
  }
}

TEST_CASE("expert parallelism: a rank count that does not divide the experts is refused, naming both") {
  test::run_ranks(3, [&](comm::Comm& comm) {
    auto moe = make_moe(ep_config("dropless", 8));
    const auto msg = test::error_of([&] { moe->set_expert_parallel(train::token_exchange(comm)); });
    CHECK(msg.find("3 ranks") != std::string::npos);
    CHECK(msg.find("8 experts") != std::string::npos);
    CHECK(moe->experts->w1.size(0) == 8);  // untouched
  });
}

TEST_CASE(
    "expert parallelism under fully_shard: shard infos, full state dicts and loading speak of whole expert "
    "tensors") {
  // World 4 as 2 groups of ep 2; the experts of a layer are a unit sharded over the 2 ranks holding them.
  MoEConfig c = ep_config("dropless", 8);
  c.layers = 2;
  c.heads = 2;
  c.vocab_size = 64;
  c.ffn_hidden = 24;
  auto build = [&] {
    std::lock_guard<std::mutex> lock(g_rng);
    at::manual_seed(3);
    return models::MoETransformer(c);
  };
  std::map<std::string, at::Tensor> reference;
  for (auto& p : build()->named_parameters()) reference[p.key()] = p.value().detach().clone();
  test::run_ranks(4, [&](comm::Comm& world) {
    const int r = world.rank();
    train::ExpertSharding experts{.ep = world.split(r / 2, r), .shard = world.split(r % 2, r)};
    auto model = build();
    train::apply_expert_parallel(*model, experts.ep);
    auto root = train::shard_model(model, world, {}, 0, experts);
    int expert_params = 0;
    for (const auto& s : fsdp::shards(*root.ptr())) {
      CAPTURE(s.name);
      CHECK(s.info.global_shape == reference.at(s.name).sizes().vec());
      if (s.name.find(".moe.experts.") == std::string::npos) continue;
      ++expert_params;
      // Experts [4 (r % 2), +4) on this rank, rows [2 (r / 2), +2) of them in its shard.
      CHECK(s.info.row_offset == 4 * (r % 2) + 2 * (r / 2));
      CHECK(s.info.local_rows == 2);
      CHECK(s.param.equal(reference.at(s.name).narrow(0, s.info.row_offset, 2)));
    }
    CHECK(expert_params == 3 * c.layers);
    auto full = fsdp::full_state_dict(*root.ptr());
    CHECK(full.size() == reference.size());
    for (auto& [name, t] : full) {
      CAPTURE(name);
      CHECK(t.equal(reference.at(name)));
      t = t * 2 + 1;
    }
    fsdp::load_full_state_dict(*root.ptr(), full);
    for (const auto& [name, t] : fsdp::full_state_dict(*root.ptr())) {
      CAPTURE(name);
      CHECK(t.equal(reference.at(name) * 2 + 1));
    }
  });
}
