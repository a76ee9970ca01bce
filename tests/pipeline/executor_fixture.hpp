#pragma once
// What the executor tests share: a small model cut into stages, its unpipelined reference, and
// a pipelined run checked against it.
#include <torch/nn/modules/linear.h>

#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <torch/optim/adamw.h>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/comm/mesh.hpp"
#include "comm/ranks.hpp"
#include "fsdp/event_log.hpp"
#include "fsdpp/pipeline/executor.hpp"
#include "fsdpp/pipeline/fsdp_stage.hpp"
#include "fsdpp/pipeline/table.hpp"
#include "pipeline/received_bytes.hpp"

namespace executor_test {

using namespace fsdpp;
using namespace fsdpp::pipeline;

constexpr int64_t kDim = 6, kMicro = 3;  // rows per microbatch

// One Linear + tanh per stage (the last without tanh); the reference runs them in sequence.
struct Model {
  std::vector<torch::nn::Linear> layers;
  explicit Model(int stages) {
    auto g = at::detail::createCPUGenerator(17);
    for (int s = 0; s < stages; ++s) {
      layers.emplace_back(kDim, kDim);
      at::NoGradGuard no_grad;
      for (auto& p : layers.back()->parameters()) p.copy_(at::randn(p.sizes(), g) * 0.5);
    }
  }
  at::Tensor stage(int s, const at::Tensor& x) {
    auto y = layers[s]->forward(x);
    return s + 1 < static_cast<int>(layers.size()) ? at::tanh(y) : y;
  }
};

// Data-parallel rank d's rows of each microbatch (rows split evenly over dp ranks).
inline std::vector<at::Tensor> dp_rows(const std::vector<at::Tensor>& microbatches, int d, int dp) {
  std::vector<at::Tensor> out;
  for (const auto& b : microbatches) out.push_back(b.narrow(0, d * b.size(0) / dp, b.size(0) / dp));
  return out;
}

struct Batch {
  std::vector<at::Tensor> x, y;
};

inline Batch make_batch(int m) {
  auto g = at::detail::createCPUGenerator(5);
  Batch b;
  for (int i = 0; i < m; ++i)
    b.x.push_back(at::randn({kMicro, kDim}, g)), b.y.push_back(at::randn({kMicro, kDim}, g));
  return b;
}

// Gradients of the mean loss over the whole batch, without pipelining.
inline std::vector<std::vector<at::Tensor>> reference_grads(int stages, int m) {
  Model ref(stages);
  const auto b = make_batch(m);
  auto h = at::cat(b.x);
  for (int s = 0; s < stages; ++s) h = ref.stage(s, h);
  at::mse_loss(h, at::cat(b.y)).backward();
  std::vector<std::vector<at::Tensor>> out;
  for (auto& l : ref.layers) out.push_back({l->weight.grad().clone(), l->bias.grad().clone()});
  return out;
}

inline double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / (b.norm().item<double>() + 1e-30);
}

// The tests' loss.
inline at::Tensor mse(const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); }

// Stage s of `model` over its fully_shard unit, computing what Model::stage does.
inline PipelineStage sharded_stage(Model& model, int s, fsdp::FullyShard<torch::nn::LinearImpl>& unit) {
  auto* u = unit.ptr().get();
  const bool last = s + 1 == static_cast<int>(model.layers.size());
  return {s,
          [u, last](const at::Tensor& x) {
            auto y = u->forward(x);
            return last ? y : at::tanh(y);
          },
          model.layers[s]->parameters(), fsdp_sharding(*u)};
}

// The stages of `model` that `plan` puts on `rank`, unsharded.
inline std::vector<PipelineStage> plain_stages(const Plan& plan, Model& model, int rank) {
  std::vector<PipelineStage> mine;
  for (int s = 0; s < plan.spec.num_stages(); ++s)
    if (plan.owner[size_t(s)] == rank)
      mine.push_back(
          {s, [&model, s](const at::Tensor& x) { return model.stage(s, x); }, model.layers[s]->parameters()});
  return mine;
}

// 5 AdamW steps of the unpipelined model on the whole batch: its parameters afterwards.
inline std::vector<std::vector<at::Tensor>> reference_params(int stages, int m) {
  Model ref(stages);
  std::vector<at::Tensor> all;
  for (auto& l : ref.layers)
    for (auto& p : l->parameters()) all.push_back(p);
  torch::optim::AdamW opt(all, torch::optim::AdamWOptions(1e-2));
  const auto b = make_batch(m);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto h = at::cat(b.x);
    for (int s = 0; s < stages; ++s) h = ref.stage(s, h);
    at::mse_loss(h, at::cat(b.y)).backward();
    opt.step();
  }
  std::vector<std::vector<at::Tensor>> out;
  for (auto& l : ref.layers) out.push_back({l->weight.detach().clone(), l->bias.detach().clone()});
  return out;
}

// Runs `plan` on threads over Gloo: checks the first step's gradients against `grads`, then the
// parameters after 5 AdamW steps against `params`, the executor's buffer counters, and the
// received bytes each rank keeps alive as the allocator sees them (received_bytes.hpp) against the
// plan's simulated peak_received.
inline void check_pipelined(const Plan& plan, const std::vector<std::vector<at::Tensor>>& grads,
                            const std::vector<std::vector<at::Tensor>>& params, const std::string& what) {
  const int stages = plan.spec.num_stages(), m = plan.spec.microbatches;
  test::CountingCpuAllocator counting;
  auto& ledger = test::ReceiveLedger::get();
  ledger.reset();
  test::run_ranks(plan.spec.pp, [&](comm::Comm& plain) {
    comm::Comm comm(std::make_shared<test::ReceiveMarkingComm>(plain.impl_ptr(), plain.rank()));
    Model model(stages);
    std::vector<PipelineStage> mine;
    std::vector<at::Tensor> mine_params;
    for (int s = 0; s < stages; ++s)
      if (plan.owner[s] == comm.rank()) {
        mine.push_back({s, [&model, s](const at::Tensor& x) { return model.stage(s, x); },
                        model.layers[s]->parameters()});
        for (auto& p : model.layers[s]->parameters()) mine_params.push_back(p);
      }
    ExecutorOptions options{{kMicro, kDim}};
    options.on_compute = [&ledger, rank = comm.rank()](const Action&, auto, auto) { ledger.sample(rank); };
    PipelineExecutor exec(plan, comm, mine, mse, options);
    torch::optim::AdamW opt(mine_params, torch::optim::AdamWOptions(1e-2));
    const auto b = make_batch(m);
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      exec.step(b.x, b.y);
      if (step == 0)
        for (const auto& st : mine) {
          INFO(what << " stage " << st.index << " gradients");
          CHECK(rel(model.layers[st.index]->weight.grad(), grads[st.index][0]) < 1e-5);
          CHECK(rel(model.layers[st.index]->bias.grad(), grads[st.index][1]) < 1e-5);
        }
      opt.step();
    }
    for (const auto& st : mine) {
      INFO(what << " stage " << st.index << " after 5 AdamW steps");
      CHECK(rel(model.layers[st.index]->weight, params[st.index][0]) < 1e-5);
      CHECK(rel(model.layers[st.index]->bias, params[st.index][1]) < 1e-5);
    }
    // Receive buffers: one allocated per RECV action when it runs, never more live than simulated.
    int recvs = 0;
    for (const auto& a : plan.lowered[comm.rank()])
      recvs += a.type == ActionType::kRecvF || a.type == ActionType::kRecvB;
    CHECK(exec.stats().recv_buffers_allocated == 5 * recvs);
    int send_f = 0;
    for (const auto& a : plan.lowered[comm.rank()]) send_f += a.type == ActionType::kSendF;
    CHECK(exec.stats().outputs_released == 5 * send_f);
    const auto sim = simulate(plan.lowered, plan.owner);
    CHECK(exec.stats().peak_recv_buffers <= sim.peak_recv_buffers[comm.rank()]);
    // Every receive wrote into a block the allocator counted, and what was received stayed alive
    // no longer than the plan says (Note [received tensors]).
    CHECK(ledger.unknown() == 0);
    const int64_t buffer_bytes = kMicro * kDim * int64_t(sizeof(float));
    INFO(what << ": rank " << comm.rank() << " kept " << ledger.peak(comm.rank()) / buffer_bytes
              << " received tensors alive at once; the plan holds " << sim.peak_received[comm.rank()]);
    CHECK(ledger.peak(comm.rank()) <= sim.peak_received[comm.rank()] * buffer_bytes);
    if (recvs > 0) CHECK(ledger.peak(comm.rank()) > 0);
  });
}

}  // namespace executor_test
