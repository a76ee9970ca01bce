// What CUDA graph capture of a whole step relies on, checked on CPU where the step runs eagerly:
// with static buffers, fully_shard's communication buffers and unsharded parameters keep their
// addresses from the first step on (and each unit is gathered once per step), as do gradients and the optimizer's state; every step issues the same collectives (operation, dtype,
// sizes, label) in the same order; inputs go through static buffers; and none of this changes a
// single bit of training.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <optional>
#include <map>
#include <chrono>
#include <nlohmann/json.hpp>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/base/device_check.hpp"
#include "comm/ranks.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/sharding.hpp"

using namespace fsdpp;

namespace {

struct RankLog {
  std::vector<double> losses;
  std::vector<std::vector<std::string>> ops;        // per step
  std::vector<std::vector<const void*>> addresses;  // per step
  int units = 0;
  std::vector<std::string> default_device_tensors;  // made in the first step (DefaultDeviceCheck)
};

std::vector<RankLog> run_steps(bool static_buffers, int steps) {
  models::MoEConfig c;
  c.dim = 32, c.heads = 2, c.layers = 2, c.max_seq_len = 32, c.ffn_hidden = 64;
  c.experts = 4, c.top_k = 2, c.expert_hidden = 32;
  c.routing = "capacity";  // static shapes
  const int n = 2;
  const int64_t B = 4, T = 16;
  // Identical initial weights on every rank, made here: the global generator is not for threads.
  std::vector<models::MoETransformer> nets;
  for (int r = 0; r < n; ++r) {
    at::manual_seed(7);
    nets.push_back(models::MoETransformer(c));
  }
  std::vector<RankLog> logs(n);
  test::run_ranks(n, [&](comm::Comm& comm) {
    const int r = comm.rank();
    fsdp::FullyShardOptions o;
    o.static_buffers = static_buffers;  // reshard_after_forward left to its default
    auto root = train::shard_model(nets[r], comm, o);
    logs[r].units = static_cast<int>(root->fsdp_unit().tree_units().size());
    fsdp::AdamW opt(root->sharded_parameters(), {.lr = 1e-2});
    auto x = at::zeros({B, T}, at::kLong), y = at::zeros({B, T}, at::kLong);  // static inputs
    const void* x_at = x.data_ptr();
    for (int step = 0; step < steps; ++step) {
      // Two batches in turn, so that the inputs change and the loss still falls.
      auto gen = at::detail::createCPUGenerator(100 * (step % 2) + r);
      const auto data = at::randint(256, {B, T + 1}, gen);
      x.copy_(data.narrow(1, 0, T));
      y.copy_(data.narrow(1, 1, T));
      const auto begin = std::chrono::system_clock::now();
      std::optional<DefaultDeviceCheck> check;
      if (step == 0) check.emplace();
      opt.zero_grad();
      const auto loss = models::lm_loss(root->forward(x), y);
      std::vector<const void*> mid;  // between forward and backward: the same places
      for (auto* u : root->fsdp_unit().tree_units())
        for (const void* a : u->group().buffer_addresses()) mid.push_back(a);
      loss.backward();
      opt.step();
      if (check) logs[r].default_device_tensors = check->findings();
      check.reset();
      logs[r].losses.push_back(loss.item<double>());
      // This rank's operations of the step, per communicator (fully_shard's are split off the one
      // given) in issue order; communicators by name.
      const auto since =
          std::chrono::duration_cast<std::chrono::microseconds>(begin.time_since_epoch()).count();
      std::map<std::string, std::vector<std::string>> per_comm;
      for (const auto& c : nlohmann::json::parse(comm::flight_records_json())) {
        if (c["rank"].get<int>() != r || c["size"].get<int>() != n) continue;
        for (const auto& e : c["entries"])
          if (e["issued_us"].get<int64_t>() >= since)
            per_comm[c["comm"].get<std::string>()].push_back(
                e["op"].get<std::string>() + " " + e["dtype"].get<std::string>() + " " +
                std::to_string(e["in"].get<int64_t>()) + " " + std::to_string(e["out"].get<int64_t>()) + " " +
                e["label"].get<std::string>());
      }
      std::vector<std::string> ops;
      for (auto& [name, list] : per_comm)
        for (auto& op : list) ops.push_back(name + ": " + op);
      logs[r].ops.push_back(ops);
      std::vector<const void*> where;
      for (auto* u : root->fsdp_unit().tree_units())
        for (const void* a : u->group().buffer_addresses()) where.push_back(a);
      if (static_buffers) CHECK(mid == where);
      // Gradients (zeroed in place) and the optimizer's state and learning rate stay put too.
      for (const auto& p : root->sharded_parameters())
        where.insert(where.end(), {p.grad().data_ptr(), opt.state(p)->exp_avg.data_ptr(),
                                   opt.state(p)->exp_avg_sq.data_ptr()});
      where.push_back(opt.lr().data_ptr());
      logs[r].addresses.push_back(where);
      REQUIRE(x.data_ptr() == x_at);
    }
  });
  return logs;
}

}  // namespace

TEST_CASE(
    "capture-ready step on CPU: fixed buffer addresses, the same collectives every step, same results") {
  const int steps = 5;
  const auto fixed = run_steps(/*static_buffers=*/true, steps);
  const auto plain = run_steps(/*static_buffers=*/false, steps);
  for (size_t r = 0; r < fixed.size(); ++r) {
    CAPTURE(r);
    CHECK(fixed[r].losses == plain[r].losses);  // bitwise
    CHECK(fixed[r].losses.back() < fixed[r].losses.front());
    for (int s = 1; s < steps; ++s) {
      CAPTURE(s);
      CHECK(fixed[r].ops[s] == fixed[r].ops[0]);
      CHECK(fixed[r].addresses[s] == fixed[r].addresses[0]);
    }
    // Every buffer is in place, and the step talks: all-gathers and reduce-scatters of each unit.
    for (const void* a : fixed[r].addresses[0]) CHECK(a != nullptr);
    CHECK(fixed[r].ops[0].size() >= 6);
    // Static buffers keep every unit gathered from forward to backward (resharding would free
    // nothing): one all-gather per unit per step, where the default gathers all but the root twice.
    auto gathers = [](const std::vector<std::string>& ops) {
      return std::count_if(ops.begin(), ops.end(), [](const std::string& op) {
        return op.find(": all_gather ") != std::string::npos;
      });
    };
    CHECK(gathers(fixed[r].ops[0]) == fixed[r].units);
    CHECK(gathers(plain[r].ops[0]) == 2 * plain[r].units - 1);
    // Every tensor the step makes is made on the step's device: none would cross to a GPU.
    CHECK(fixed[r].default_device_tensors == std::vector<std::string>{});
    CHECK(plain[r].default_device_tensors == std::vector<std::string>{});
  }
}

namespace {

// The pattern DefaultDeviceCheck exists for: a backward that makes its gradient on the default
// device, as the MoE's auxiliary-loss hook once did.
struct ScalarGradOnDefaultDevice : torch::autograd::Function<ScalarGradOnDefaultDevice> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x, at::Tensor aux) { return x; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::full({}, 0.5, at::TensorOptions().dtype(grads[0].scalar_type()))};
  }
};
struct ScalarGradOnInputDevice : torch::autograd::Function<ScalarGradOnInputDevice> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x, at::Tensor aux) { return x; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::full({}, 0.5, grads[0].options())};
  }
};

}  // namespace

TEST_CASE("DefaultDeviceCheck names tensors made without a device, in forward and in backward") {
  const auto x = at::randn({4, 3}).requires_grad_(true), aux = at::zeros({}).requires_grad_(true);
  {
    DefaultDeviceCheck check;
    auto y = ScalarGradOnInputDevice::apply(x * 2 + 1, aux);     // operators' own tensors follow their inputs
    auto z = at::zeros({4, 3}, x.options()) + at::ones_like(y);  // options from an input
    (y * z).sum().backward();
    CHECK(check.findings() == std::vector<std::string>{});
  }
  DefaultDeviceCheck check;
  auto y = ScalarGradOnDefaultDevice::apply(x, aux);
  for (int i = 0; i < 2; ++i) (y + at::zeros({4, 3})).sum().backward({}, /*retain_graph=*/true);
  const auto found = check.findings();
  REQUIRE(found.size() == 2);
  CHECK(found[0] == "aten::zeros without a device, in forward (2 times)");
  CHECK(found[1].find("aten::full without a device, in the backward of ") == 0);
  CHECK(found[1].find("ScalarGradOnDefaultDevice") != std::string::npos);
  CHECK(found[1].find("(2 times)") != std::string::npos);
}
