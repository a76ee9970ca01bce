// The model's weight products by ATen (MKL's sgemm), forward and backward, at moe-small's shapes for
// one microbatch of a dp 2 rank (8 x 128 = 1024 tokens), interleaved rounds, medians; one thread
// unless --threads. MKL's choice of kernels holds for the whole process (Note [MKL's kernels on
// other vendors' CPUs]), so bench/run_matmul_bench.sh runs this once each way, alternating.
//   qkv       x [rows, 128] W^T, W [384, 128]            (the attention's projection)
//   w2        x [rows, 384] W^T, W [128, 384]            (the dense SwiGLU's down projection)
//   experts   the 4 experts' w1 on rows x top-2, grouped  x [2 rows, 128], W [4, 192, 128]; the
//             split between experts changes every call (drawn from 64 random splits), as dropless
//             routing's does
//   fsdpp_matmul_bench [--threads N] [--rounds R] [--rows N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fsdpp/base/mkl_dispatch.hpp"
#include "fsdpp/models/cpu/matmul.hpp"
#include "interleaved.hpp"
#include "options.hpp"

using namespace fsdpp;

int main(int argc, char** argv) {
  int64_t threads = 1, rounds = 7, rows = 8 * 128;
  if (!bench::parse_options(argc, argv, "matmul_bench",
                            {{"threads", &threads}, {"rounds", &rounds}, {"rows", &rows}}))
    return 2;
  at::set_num_threads(int(threads));
  const int64_t dim = 128, hidden = 384, experts = 4, expert_hidden = 192;  // moe-small
  at::manual_seed(0);
  auto param = [](std::vector<int64_t> shape) { return (0.05 * at::randn(shape)).requires_grad_(); };
  const auto x = at::randn({rows, dim}).requires_grad_(), h = at::randn({rows, hidden}).requires_grad_();
  const auto routed = at::randn({2 * rows, dim}).requires_grad_();
  const auto wqkv = param({3 * dim, dim}), w2 = param({dim, hidden}),
             we = param({experts, expert_hidden, dim});
  const auto gqkv = at::randn({rows, 3 * dim}), g2 = at::randn({rows, dim}),
             ge = at::randn({2 * rows, expert_hidden});
  std::vector<at::Tensor> splits;  // cumulative row counts of the experts, 64 random splits
  for (int i = 0; i < 64; ++i) {
    const auto share = at::rand({experts}) + 0.5;
    auto ends = (share.cumsum(0) / share.sum() * double(2 * rows)).round().to(at::kInt);
    ends[experts - 1] = int(2 * rows);
    splits.push_back(ends);
  }
  size_t next = 0;
  std::map<std::string, std::function<void()>> ways = {
      {"qkv", [&] { models::linear(x, wqkv, false).backward(gqkv); }},
      {"w2", [&] { models::linear(h, w2, false).backward(g2); }},
      {"experts",
       [&] { models::grouped_linear(routed, we, splits[next++ % splits.size()], false).backward(ge); }},
  };
  const std::vector<std::string> order{"qkv", "w2", "experts"};
  auto call = [&](const std::string& way) {
    for (const auto* t : {&x, &h, &routed, &wqkv, &w2, &we})
      const_cast<at::Tensor&>(*t).mutable_grad() = at::Tensor();
    ways[way]();
  };
  for (const auto& way : order) call(way);  // MKL's first calls out of the timing
  const auto t = bench::interleave(order, call, int(rounds), /*per_round=*/10);
  fmt::print("MKL: {}\n", mkl_dispatch().detail);
  for (const auto& way : order)
    fmt::print("RESULT matmul way={} rows={} threads={} fwd_bwd_ms={:.3f}\n", way, rows, threads,
               t.median_ms(way));
  return 0;
}
