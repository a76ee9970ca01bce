// Register your own pipeline schedule, then validate, simulate and run it like a built-in one:
//   build/fsdpp launch --nproc 2 -- build/example_custom_schedule
// "Eager1F1B" is 1F1B with one more warm-up forward per rank: it keeps an extra activation alive
// to give the next stage work sooner. The plan proves it deadlock-free before anything runs.
#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <iostream>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/pipeline/executor.hpp"
#include "fsdpp/pipeline/visualize.hpp"

using namespace fsdpp;
using namespace fsdpp::pipeline;

class Eager1F1B : public Schedule {
 public:
  std::string name() const override { return "Eager1F1B"; }
  Program compute_actions(const ScheduleSpec& s) const override {
    Program p(s.pp);
    for (int r = 0; r < s.pp; ++r) {
      const int warmup = std::min(s.microbatches, s.pp - r + 1);
      int f = 0, b = 0;
      while (f < warmup) p[r].push_back({r, ActionType::kForward, f++});
      while (b < s.microbatches) {
        p[r].push_back({r, ActionType::kBackward, b++});
        if (f < s.microbatches) p[r].push_back({r, ActionType::kForward, f++});
      }
    }
    return p;
  }
};

int main() {
  register_schedule("Eager1F1B", [] { return std::make_unique<Eager1F1B>(); });
  auto comm = comm::init_from_env();
  const ScheduleSpec spec{.pp = comm.size(), .stages_per_rank = 1, .microbatches = 6};
  const Plan plan = make_plan(*make_schedule("Eager1F1B"), spec);
  if (comm.rank() == 0) {
    for (const char* name : {"1F1B", "Eager1F1B"}) {
      const Plan p = make_plan(*make_schedule(name), spec);
      const auto sim = simulate(p.lowered, p.owner);
      std::cout << name << ": bubble " << sim.mean_bubble() << ", peak activations on rank 0 "
                << sim.peak_activations[0] << "\n";
    }
    std::cout << render_timeline(simulate(plan.lowered, plan.owner));
  }

  // Run it: one Linear stage per rank, the same weights everywhere (seeded).
  at::manual_seed(0);
  std::vector<torch::nn::Linear> layers;
  for (int s = 0; s < comm.size(); ++s) layers.push_back(torch::nn::Linear(8, 8));
  auto& mine = layers[comm.rank()];
  PipelineStage stage{.index = comm.rank(),
                      .forward = [&](const at::Tensor& x) { return at::tanh(mine(x)); },
                      .parameters = mine->parameters()};
  PipelineExecutor exec(plan, comm, {stage},
                        [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); },
                        {.activation_shape = {4, 8}});  // each microbatch: 4 rows of 8
  torch::optim::SGD opt(mine->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<at::Tensor> xs, ys;
  for (int m = 0; m < spec.microbatches; ++m)
    xs.push_back(at::randn({4, 8})), ys.push_back(at::randn({4, 8}).tanh());
  for (int step = 1; step <= 30; ++step) {
    opt.zero_grad();
    const double loss = exec.step(xs, ys);
    opt.step();
    if (comm.rank() == comm.size() - 1 && step % 10 == 0)
      std::cout << "step " << step << ": loss " << loss << "\n";
  }
}
