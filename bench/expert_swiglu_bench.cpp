// The MoE layer's expert SwiGLU (models/cpu/kernels.hpp) at moe-small's shapes (4 experts, dim 128,
// expert_hidden 192, every expert given the same rows; other counts and widths by option), forward
// and backward, with the caches cleared (64 MB written, untimed) before the forward and before the
// backward, as a training step meets its operands:
//   composition   models::expert_swiglu_reference: models::grouped_linear (at::_grouped_mm) for w1,
//                 w3 and w2 and models::swiglu's gate, under autograd (the model before the kernel)
//   kernel-C      models::expert_swiglu with chunks of C rows (C = rows: each expert whole)
//   dense         with --experts 1 only: the dense layer's SwiGLU as the model runs it (at::linear for
//                 w1, w3 and w2, models::swiglu's gate), beside the kernel given the layer as one expert
// The ways alternate within each round, each round starting one further along; medians.
//   fsdpp_expert_swiglu_bench [--threads N] [--rounds R] [--rows ROWS_PER_EXPERT] [--experts E] [--hidden H]
// (E 4 and H 192 by default: moe-small's experts; --experts 1 --hidden 384 is its dense layer)
// Prints one line per way:
//   RESULT expert_swiglu rows=R threads=T way=W forward_ms=F backward_ms=B total_ms=S speedup=X
// (speedup: the composition's total over the way's, the median of the rounds' ratios).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fsdpp/models/cpu/kernels.hpp"
#include "options.hpp"

using namespace fsdpp;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t threads = 1, rounds = 15, rows = 1024, E = 4, H = 192;
  if (!bench::parse_options(
          argc, argv, "expert_swiglu_bench",
          {{"threads", &threads}, {"rounds", &rounds}, {"rows", &rows}, {"experts", &E}, {"hidden", &H}}))
    return 2;
  if (threads < 1 || rounds < 1 || rows < 1 || E < 1 || H < 1) {
    fmt::print(
        stderr,
        "expert_swiglu_bench: --threads, --rounds, --rows, --experts and --hidden must be at least 1\n");
    return 2;
  }
  at::set_num_threads(int(threads));
  const int64_t D = 128;  // moe-small's dim
  at::manual_seed(0);
  const auto x = (at::randn({E * rows, D}) * 0.5).requires_grad_(), dy = at::randn({E * rows, D}) * 0.1;
  const auto w1 = (at::randn({E, H, D}) * 0.1).requires_grad_(),
             w3 = (at::randn({E, H, D}) * 0.1).requires_grad_(),
             w2 = (at::randn({E, D, H}) * 0.1).requires_grad_();
  const auto ends = (at::arange(1, E + 1, at::kLong) * rows).to(at::kInt);
  std::vector<char> junk(64 << 20);
  const auto clear_caches = [&] { std::memset(junk.data(), junk[7] + 1, junk.size()); };

  struct Way {
    std::string name;
    std::function<at::Tensor()> forward;
    std::vector<double> fwd, bwd;
  };
  std::vector<Way> ways;
  ways.push_back(
      {"composition", [&] { return models::expert_swiglu_reference(x, w1, w3, w2, ends); }, {}, {}});
  if (E == 1)
    ways.push_back(
        {"dense",
         [&] { return at::linear(models::swiglu(at::linear(x, w1[0]), at::linear(x, w3[0])), w2[0]); },
         {},
         {}});
  // Chunk sizes up to the rows per expert, the last the whole expert (once, where the rows are one
  // of the sizes before it).
  for (const int64_t c : {int64_t(64), int64_t(128), int64_t(256), int64_t(512), rows})
    if (c < rows || (c == rows && ways.back().name != fmt::format("kernel-{}", c)))
      ways.push_back({fmt::format("kernel-{}", c),
                      [&, c] { return models::expert_swiglu(x, w1, w3, w2, ends, c); },
                      {},
                      {}});

  using Clock = std::chrono::steady_clock;
  const auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  const auto once = [&](Way& w, bool keep) {
    for (const auto* t : {&x, &w1, &w3, &w2}) t->mutable_grad() = at::Tensor();
    clear_caches();
    const auto t0 = Clock::now();
    const auto y = w.forward();
    const auto t1 = Clock::now();
    clear_caches();
    const auto t2 = Clock::now();
    y.backward(dy);
    const auto t3 = Clock::now();
    if (keep) w.fwd.push_back(ms(t0, t1)), w.bwd.push_back(ms(t2, t3));
  };
  for (auto& w : ways) once(w, false), once(w, false);
  for (int64_t r = 0; r < rounds; ++r)
    for (size_t i = 0; i < ways.size(); ++i) once(ways[(i + size_t(r)) % ways.size()], true);

  const auto& base = ways.front();
  for (const auto& w : ways) {
    std::vector<double> ratio;
    for (int64_t r = 0; r < rounds; ++r) ratio.push_back((base.fwd[r] + base.bwd[r]) / (w.fwd[r] + w.bwd[r]));
    const double f = median(w.fwd), b = median(w.bwd);
    fmt::print(
        "RESULT expert_swiglu rows={} threads={} way={} forward_ms={:.3f} backward_ms={:.3f} total_ms={:.3f} "
        "speedup={:.3f}\n",
        rows, threads, w.name, f, b, f + b, median(ratio));
  }
}
