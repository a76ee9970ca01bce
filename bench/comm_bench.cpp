// Algorithm and bus bandwidth of fsdpp's Gloo communicator for all_gather, reduce_scatter and
// all_reduce, in float32 or bfloat16: one round over every size. bench/run_comm_bench.sh alternates
// rounds of this program with rounds of bench/torch_gloo_bench.py (PyTorch's own ProcessGroupGloo,
// the same sizes) and reports medians side by side.
// Run under the launcher:  fsdpp launch --nproc N -- fsdpp_comm_bench [--max-mib 64] [--dtype bfloat16]
//
// Sizes follow the nccl-tests convention: the size of the whole buffer (all_reduce), of the
// gathered output (all_gather) or of the scattered input (reduce_scatter). Each time is the slowest
// rank's mean over the iterations. Rank 0 prints one JSON line per operation and size.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>

#include "fsdpp/comm/init.hpp"

using namespace fsdpp;

namespace {

// Mean seconds per call of `op` over `iters` calls, the slowest rank's (after one warm-up call).
double time_round(comm::Comm& comm, int iters, const std::function<void()>& op) {
  op();
  comm.barrier().wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) op();
  const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto secs = at::full({1}, mine / iters, at::kDouble);
  comm.all_reduce(secs, {comm::ReduceOp::kMax}).wait();
  return secs.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t max_mib = 64;
  std::string dtype = "float32";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--max-mib") == 0) max_mib = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--dtype") == 0) dtype = argv[i + 1];
  }
  if (dtype != "float32" && dtype != "bfloat16") {
    std::cerr << "fsdpp_comm_bench: --dtype must be float32 or bfloat16, got " << dtype << "\n";
    return 2;
  }
  const auto type = dtype == "float32" ? at::kFloat : at::kBFloat16;
  const int64_t esize = dtype == "float32" ? 4 : 2;
  auto comm = comm::init_from_env();
  const int n = comm.size();
  for (const std::string op : {"all_gather", "reduce_scatter", "all_reduce"}) {
    for (int64_t bytes = 4 << 10; bytes <= (max_mib << 20); bytes *= 4) {
      const int64_t chunk = bytes / esize / n;
      const int iters = static_cast<int>(std::clamp<int64_t>((64LL << 20) / bytes, 3, 100));
      auto full = at::ones({chunk * n}, type);
      auto part = at::ones({chunk}, type);
      std::function<void()> run;
      if (op == "all_gather")
        run = [&] { comm.all_gather(full, part).wait(); };
      else if (op == "reduce_scatter")
        run = [&] { comm.reduce_scatter(part, full).wait(); };
      else
        run = [&] { comm.all_reduce(full).wait(); };
      const double secs = time_round(comm, iters, run);
      if (comm.rank() == 0)
        std::cout
            << fmt::format(
                   R"({{"impl": "fsdpp", "world": {}, "op": "{}", "dtype": "{}", "bytes": {}, "seconds": {:.9f}}})",
                   n, op, dtype, chunk * n * esize, secs)
            << std::endl;
    }
  }
  comm.barrier().wait();
  return 0;
}
