// A dp 1 step's two microbatches on 2 cores, forward and backward, two ways side by side
// (interleaved rounds, medians; bench/interleaved.hpp):
//   sequential  one microbatch after the other, every operator on 2 intra-op threads: what
//               `fsdpp run recipes/moe-small.json parallel.dp=1` does by default.
//   concurrent  both at once, one on each of two threads, every operator on 1 thread (what
//               cpu.microbatch_threads=2 does, there on the gathered parameters). The second
//               thread runs a second copy of the model whose parameters share the first copy's
//               storage (its own gradients and router statistics, so the threads write nothing in
//               common); its gradients are then added into the first copy's, which completes the step.
// The gradients of the two ways are compared too (largest difference relative to the largest
// gradient): the same sums, possibly rounded differently since the products run on other thread counts.
//   fsdpp_microbatch_threads_bench [--rounds R] [--per-round K] [--micro-batch B] [--seq T] [--config F]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/recipe.hpp"
#include "interleaved.hpp"

using namespace fsdpp;

namespace {

// One microbatch's forward and backward; the loss is the step's mean over both microbatches.
void forward_backward(models::MoETransformerImpl& model, const at::Tensor& x, const at::Tensor& y) {
  (models::lm_loss(model.forward(x), y) / 2.0).backward();
}

std::vector<at::Tensor> grads(models::MoETransformerImpl& model) {
  std::vector<at::Tensor> g;
  for (const auto& p : model.parameters())
    g.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return g;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 7, per_round = 5;
  int64_t micro_batch = 16, seq = 128;
  std::string config_path = "configs/moe-small.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--rounds")
      rounds = std::atoi(v.c_str());
    else if (a == "--per-round")
      per_round = std::atoi(v.c_str());
    else if (a == "--micro-batch")
      micro_batch = std::atol(v.c_str());
    else if (a == "--seq")
      seq = std::atol(v.c_str());
    else if (a == "--config")
      config_path = v;
    else {
      fmt::print(stderr, "microbatch_threads_bench: unknown option {}\n", a);
      return 2;
    }
  }
  std::ifstream file(config_path);
  if (!file) {
    fmt::print(stderr,
               "microbatch_threads_bench: cannot read {} (run from the repository root or give --config)\n",
               config_path);
    return 2;
  }
  const auto config = train::parse_model_config(nlohmann::json::parse(file), config_path);

  at::manual_seed(1234);
  models::MoETransformer first(config), second(config);
  {
    // The second copy's parameters view the first's storage: one set of weights, two gradients.
    at::NoGradGuard g;
    auto a = first->parameters(), b = second->parameters();
    if (a.size() != b.size()) throw std::logic_error("two copies of one model differ in parameters");
    for (size_t i = 0; i < a.size(); ++i) b[i].set_data(a[i].detach());
  }
  std::vector<at::Tensor> xs, ys;
  for (int j = 0; j < 2; ++j) {
    const auto tokens = at::randint(0, config.vocab_size, {micro_batch, seq + 1}, at::kLong);
    xs.push_back(tokens.narrow(1, 0, seq).contiguous());
    ys.push_back(tokens.narrow(1, 1, seq).contiguous());
  }

  auto sequential = [&] {
    at::set_num_threads(2);
    first->zero_grad();
    forward_backward(*first, xs[0], ys[0]);
    forward_backward(*first, xs[1], ys[1]);
  };
  auto concurrent = [&] {
    // OpenMP's thread count is per thread: each sets its own.
    at::set_num_threads(1);
    first->zero_grad();
    second->zero_grad();
    std::thread other([&] {
      at::set_num_threads(1);
      forward_backward(*second, xs[1], ys[1]);
    });
    forward_backward(*first, xs[0], ys[0]);
    other.join();
    at::NoGradGuard g;
    auto a = first->parameters(), b = second->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      const auto& gb = b[i].grad();
      if (!gb.defined()) continue;  // a parameter the second microbatch did not reach
      if (a[i].grad().defined())
        a[i].mutable_grad().add_(gb);
      else
        a[i].mutable_grad() = gb.clone();
    }
  };

  sequential();
  const auto seq_grads = grads(*first);
  concurrent();
  const auto conc_grads = grads(*first);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < seq_grads.size(); ++i) {
    diff = std::max(diff, (seq_grads[i] - conc_grads[i]).abs().max().item<double>());
    scale = std::max(scale, seq_grads[i].abs().max().item<double>());
  }

  const auto t = bench::interleave(
      {"sequential", "concurrent"},
      [&](const std::string& w) { w == "sequential" ? sequential() : concurrent(); }, rounds, per_round);
  const double tokens = double(2 * micro_batch * seq);
  for (const auto& w : {"sequential", "concurrent"}) {
    std::string each;
    for (double ms : t.ms.at(w)) each += fmt::format(" {:.1f}", ms);
    fmt::print("{}: {:.1f} ms per step's forward and backward ({:.0f} tokens/s); rounds:{}\n", w,
               t.median_ms(w), tokens / t.median_ms(w) * 1e3, each);
  }
  fmt::print(
      "RESULT microbatch-threads rounds={} tokens_per_step={:.0f} sequential_ms={:.1f} concurrent_ms={:.1f} "
      "speedup={:.3f} grad_max_rel_diff={:.1e}\n",
      rounds, tokens, t.median_ms("sequential"), t.median_ms("concurrent"),
      t.ratio("sequential", "concurrent"), scale > 0 ? diff / scale : diff);
}
