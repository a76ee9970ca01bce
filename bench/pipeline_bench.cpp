// Measured pipeline bubbles beside the simulator's prediction and the closed form.
//   fsdpp launch --nproc P -- fsdpp_pipeline_bench SCHEDULE MICROBATCHES [UNIT_MS]
// Each stage's forward sleeps one time unit and its backward one unit per gradient it computes
// (input and weight: B = 2, I = W = 1), so the measurement shows the schedule, not how many cores
// the machine has. Bubble = 1 - (time spent in stage compute) / step time, averaged over ranks.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/pipeline/executor.hpp"

using namespace fsdpp;
using namespace fsdpp::pipeline;

namespace {

int g_unit_ms = 10;
double g_busy = 0;  // seconds actually spent in stage compute on this rank

void spend(int units) {
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(units * g_unit_ms));
  g_busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Sleepy : torch::autograd::Function<Sleepy> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x, const at::Tensor& w) {
    spend(1);
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const bool dx = ctx->needs_input_grad(0), dw = ctx->needs_input_grad(1);
    spend(int(dx) + int(dw));
    return {dx ? g[0] : at::Tensor(), dw ? g[0].sum().reshape({1}) : at::Tensor()};
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: fsdpp_pipeline_bench SCHEDULE MICROBATCHES [UNIT_MS]\n";
    return 2;
  }
  const std::string name = argv[1];
  const int m = std::atoi(argv[2]);
  if (argc > 3) g_unit_ms = std::atoi(argv[3]);
  auto comm = comm::init_from_env();
  const int pp = comm.size();
  auto schedule = make_schedule(name);
  const int v =
      (name == "ZBVZeroBubble" || name == "DualPipeV" || name == "Interleaved1F1B" || name == "LoopedBFS")
          ? 2
          : 1;
  const ScheduleSpec spec{.pp = pp, .stages_per_rank = v, .microbatches = m};
  const auto plan = make_plan(*schedule, spec);
  std::vector<at::Tensor> weights(spec.num_stages());
  std::vector<PipelineStage> mine;
  for (int s = 0; s < spec.num_stages(); ++s)
    if (plan.owner[s] == comm.rank()) {
      weights[s] = at::ones({1}).requires_grad_(true);
      auto w = weights[s];
      mine.push_back({s, [w](const at::Tensor& x) { return Sleepy::apply(x, w); }, {w}});
    }
  PipelineExecutor exec(plan, comm, mine, [](const at::Tensor& out, const at::Tensor&) { return out.sum(); },
                        {{2, 4}});
  std::vector<at::Tensor> xs(m, at::ones({2, 4})), ys(m, at::ones({2, 4}));
  exec.step(xs, ys);  // warm-up
  comm.barrier().wait();
  g_busy = 0;
  const auto t0 = std::chrono::steady_clock::now();
  exec.step(xs, ys);
  const double step = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double measured = 1 - g_busy / step;
  if (std::getenv("FSDPP_BENCH_VERBOSE"))
    std::cerr << fmt::format("rank {} step {:.1f} ms busy {:.1f} ms\n", comm.rank(), step * 1e3,
                             g_busy * 1e3);
  Costs costs{1, 2, 1, 1, 0};
  costs.first_stage_skips_input_grad = true;  // as the executor does (stage 0's input needs no gradient)
  const auto sim = simulate(plan.lowered, plan.owner, costs);
  auto all = at::zeros({pp}, at::kDouble);
  all[comm.rank()] = measured;
  comm.all_reduce(all).wait();
  if (comm.rank() == 0) {
    double mean_measured = 0;
    for (int r = 0; r < pp; ++r) mean_measured += all[r].item<double>() / pp;
    const bool closed = name == "GPipe" || name == "1F1B";
    const auto uniform = simulate(plan.lowered, plan.owner, Costs{1, 2, 1, 1, 0});
    std::cout << fmt::format("| {} | {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {} |\n", name, pp, v, m,
                             mean_measured, sim.mean_bubble(), uniform.mean_bubble(),
                             closed ? fmt::format("{:.3f}", double(pp - 1) / (m + pp - 1)) : "-");
  }
  comm.barrier().wait();
  return 0;
}
