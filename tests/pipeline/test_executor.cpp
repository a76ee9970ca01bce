// The executor runs every built-in schedule on real stages over Gloo and gives the gradients of
// the unpipelined model.
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "dist/mesh.hpp"
#include "dist/ranks.hpp"
#include "pipeline/executor.hpp"

using namespace fsdpp;
using namespace fsdpp::pipeline;

namespace {

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

struct Batch {
  std::vector<at::Tensor> x, y;
};

Batch make_batch(int m) {
  auto g = at::detail::createCPUGenerator(5);
  Batch b;
  for (int i = 0; i < m; ++i) b.x.push_back(at::randn({kMicro, kDim}, g)), b.y.push_back(at::randn({kMicro, kDim}, g));
  return b;
}

// Gradients of the mean loss over the whole batch, without pipelining.
std::vector<std::vector<at::Tensor>> reference_grads(int stages, int m) {
  Model ref(stages);
  const auto b = make_batch(m);
  auto h = at::cat(b.x);
  for (int s = 0; s < stages; ++s) h = ref.stage(s, h);
  at::mse_loss(h, at::cat(b.y)).backward();
  std::vector<std::vector<at::Tensor>> out;
  for (auto& l : ref.layers) out.push_back({l->weight.grad().clone(), l->bias.grad().clone()});
  return out;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / (b.norm().item<double>() + 1e-30);
}

}  // namespace

TEST_CASE("every built-in schedule gives the unpipelined gradients (pp 2 and 4)") {
  struct Case {
    std::string name;
    int v;
  };
  for (const auto& c : std::vector<Case>{{"GPipe", 1}, {"1F1B", 1}, {"LoopedBFS", 2}, {"Interleaved1F1B", 2},
                                         {"InterleavedZeroBubble", 1}, {"ZBVZeroBubble", 2}})
    for (int pp : {2, 4})
      for (int m : {pp, 2 * pp, 2 * pp + 1}) {
        auto schedule = make_schedule(c.name);
        const ScheduleSpec spec{pp, c.v, m};
        try {
          schedule->check(spec);
        } catch (const ScheduleError&) {
          continue;  // e.g. interleaved schedules refuse some microbatch counts (tested elsewhere)
        }
        const auto plan = make_plan(*schedule, spec);
        const int stages = spec.num_stages();
        const auto want = reference_grads(stages, m);
        test::run_ranks(pp, [&](dist::Comm& comm) {
          Model model(stages);
          std::vector<PipelineStage> mine;
          for (int s = 0; s < stages; ++s)
            if (plan.owner[s] == comm.rank())
              mine.push_back({s, [&model, s](const at::Tensor& x) { return model.stage(s, x); },
                              model.layers[s]->parameters()});
          PipelineExecutor exec(plan, comm, mine,
                                [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); },
                                {{kMicro, kDim}});
          const auto b = make_batch(m);
          exec.step(b.x, b.y);
          for (const auto& st : mine) {
            INFO(c.name << " pp=" << pp << " m=" << m << " stage " << st.index);
            CHECK(rel(model.layers[st.index]->weight.grad(), want[st.index][0]) < 1e-5);
            CHECK(rel(model.layers[st.index]->bias.grad(), want[st.index][1]) < 1e-5);
          }
          // Buffers are allocated per receive and never more are live than the simulator says.
          const auto sim = simulate(plan.lowered, plan.owner);
          CHECK(exec.stats().peak_recv_buffers <= sim.peak_recv_buffers[comm.rank()]);
        });
      }
}

TEST_CASE("a send budget is never exceeded and changes no result") {
  for (const auto& [name, v] : std::vector<std::pair<std::string, int>>{{"1F1B", 1}, {"Interleaved1F1B", 2}, {"ZBVZeroBubble", 2}})
    for (int budget : {1, 2}) {
      const ScheduleSpec spec{4, v, 8};
      const auto plan = make_plan(*make_schedule(name), spec, false, budget);
      const auto want = reference_grads(spec.num_stages(), 8);
      test::run_ranks(4, [&](dist::Comm& comm) {
        Model model(spec.num_stages());
        std::vector<PipelineStage> mine;
        for (int s = 0; s < spec.num_stages(); ++s)
          if (plan.owner[s] == comm.rank())
            mine.push_back({s, [&model, s](const at::Tensor& x) { return model.stage(s, x); },
                            model.layers[s]->parameters()});
        PipelineExecutor exec(plan, comm, mine,
                              [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); },
                              {{kMicro, kDim}});
        const auto b = make_batch(8);
        exec.step(b.x, b.y);
        INFO(name << " budget " << budget << " rank " << comm.rank());
        CHECK(exec.stats().sends > 0);
        CHECK(exec.stats().peak_sends_in_flight <= budget);
        for (const auto& st : mine) CHECK(rel(model.layers[st.index]->weight.grad(), want[st.index][0]) < 1e-5);
      });
    }
}

TEST_CASE("5 AdamW steps of 1F1B at pp 4 match unpipelined training; two runs are bitwise equal") {
  const int pp = 4, m = 8;
  const auto plan = make_plan(*make_schedule("1F1B"), {pp, 1, m});
  auto train_pipelined = [&](std::vector<std::vector<at::Tensor>>& params_out) {
    params_out.assign(pp, {});
    std::vector<double> losses(5, 0);
    test::run_ranks(pp, [&](dist::Comm& comm) {
      Model model(pp);
      const int s = comm.rank();
      PipelineExecutor exec(plan, comm, {{s, [&model, s](const at::Tensor& x) { return model.stage(s, x); },
                                          model.layers[s]->parameters()}},
                            [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); },
                            {{kMicro, kDim}});
      torch::optim::AdamW opt(model.layers[s]->parameters(), torch::optim::AdamWOptions(1e-2));
      const auto b = make_batch(m);
      for (int step = 0; step < 5; ++step) {
        opt.zero_grad();
        const double loss = exec.step(b.x, b.y);
        opt.step();
        if (s == pp - 1) losses[step] = loss;
      }
      for (auto& p : model.layers[s]->parameters()) params_out[s].push_back(p.detach().clone());
    });
    return losses;
  };
  std::vector<std::vector<at::Tensor>> p1, p2;
  const auto l1 = train_pipelined(p1);
  const auto l2 = train_pipelined(p2);

  Model ref(pp);
  torch::optim::AdamW opt(
      [&] {
        std::vector<at::Tensor> all;
        for (auto& l : ref.layers)
          for (auto& p : l->parameters()) all.push_back(p);
        return all;
      }(),
      torch::optim::AdamWOptions(1e-2));
  const auto b = make_batch(m);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto h = at::cat(b.x);
    for (int s = 0; s < pp; ++s) h = ref.stage(s, h);
    auto loss = at::mse_loss(h, at::cat(b.y));
    loss.backward();
    opt.step();
    CHECK(std::abs(l1[step] - loss.item<double>()) <= 1e-5 * loss.item<double>());
  }
  for (int s = 0; s < pp; ++s)
    for (size_t i = 0; i < p1[s].size(); ++i) {
      CHECK(rel(p1[s][i], ref.layers[s]->parameters()[i]) < 1e-5);
      CHECK(at::equal(p1[s][i], p2[s][i]));  // deterministic
    }
  CHECK(l1 == l2);
}

TEST_CASE("dp=2 x pp=2 with fully_shard stages matches unpipelined, unsharded training") {
  const int pp = 2, dp = 2, m = 4, rows = 4;  // each microbatch's 4 rows split over dp
  auto g = at::detail::createCPUGenerator(9);
  std::vector<at::Tensor> xs, ys;
  for (int i = 0; i < m; ++i) xs.push_back(at::randn({rows, kDim}, g)), ys.push_back(at::randn({rows, kDim}, g));
  for (const std::string name : {"1F1B", "GPipe"}) {
    const auto plan = make_plan(*make_schedule(name), {pp, 1, m}, /*fsdp_stages=*/true, /*max_outstanding_sends=*/2);
    // Reference: 3 AdamW steps on the whole batch, one process, no sharding.
    Model ref(pp);
    std::vector<at::Tensor> all;
    for (auto& l : ref.layers)
      for (auto& p : l->parameters()) all.push_back(p);
    torch::optim::AdamW ropt(all, torch::optim::AdamWOptions(1e-2));
    std::vector<double> want_loss;
    for (int step = 0; step < 3; ++step) {
      ropt.zero_grad();
      auto h = at::cat(xs);
      for (int s = 0; s < pp; ++s) h = ref.stage(s, h);
      auto loss = at::mse_loss(h, at::cat(ys));
      loss.backward();
      ropt.step();
      want_loss.push_back(loss.item<double>());
    }
    test::run_ranks(pp * dp, [&](dist::Comm& world) {
      dist::DeviceMesh mesh(world, {{"pp", pp}, {"dp", dp}});
      const int s = mesh.coord("pp"), d = mesh.coord("dp");
      Model model(pp);
      auto unit = fsdp::fully_shard(model.layers[s].ptr(), mesh.comm("dp"));
      const bool last = s == pp - 1;
      PipelineExecutor exec(plan, mesh.comm("pp"),
                            {{s, [&unit, last](const at::Tensor& x) { auto y = unit->forward(x); return last ? y : at::tanh(y); },
                              model.layers[s]->parameters(), unit.ptr().get()}},
                            [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); },
                            {{rows / dp, kDim}});
      std::vector<at::Tensor> lx, ly;
      for (int i = 0; i < m; ++i) lx.push_back(xs[i].narrow(0, d * rows / dp, rows / dp)), ly.push_back(ys[i].narrow(0, d * rows / dp, rows / dp));
      torch::optim::AdamW opt(unit->sharded_parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        auto loss = at::full({1}, exec.step(lx, ly), at::kDouble);
        opt.step();
        mesh.comm("dp").all_reduce(loss, {dist::ReduceOp::kAvg}).wait();
        if (last) {
          INFO(name << " step " << step << " rank " << world.rank());
          CHECK(std::abs(loss.item<double>() - want_loss[step]) <= 1e-5 * want_loss[step]);
        }
      }
      for (const auto& [pname, full] : fsdp::full_state_dict(*unit.ptr())) {
        INFO(name << " stage " << s << " " << pname);
        CHECK(rel(full, ref.layers[s]->named_parameters()[pname]) < 1e-5);
      }
    });
  }
}
