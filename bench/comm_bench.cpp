// Algorithm and bus bandwidth of fsdpp's Gloo communicator beside LibTorch's own
// c10d::ProcessGroupGloo, for all_gather, reduce_scatter and all_reduce, in one run.
// Run under the launcher:  fsdpp launch --nproc N -- fsdpp_comm_bench [--max-mib 64]
//
// Sizes follow the nccl-tests convention: the size of the whole buffer (all_reduce), of the
// gathered output (all_gather) or of the scattered input (reduce_scatter). algbw = size / time;
// busbw = algbw * 2(n-1)/n for all_reduce and algbw * (n-1)/n for the other two. Each time is the
// slowest rank's mean over a round of iterations; the two implementations alternate over 7 rounds
// and each reports its median round, so drift on a busy machine hits both alike.
#define USE_C10D_GLOO 1
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <optional>

#include "dist/init.hpp"
#include "fsdpp/blas.hpp"

using namespace fsdpp;

namespace {

struct Env {
  dist::Comm comm;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

// Mean seconds per call of `op` over `iters` calls, the slowest rank's.
double time_round(Env& env, int iters, const std::function<void()>& op) {
  env.comm.barrier().wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) op();
  const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto secs = at::full({1}, mine / iters, at::kDouble);
  env.comm.all_reduce(secs, {dist::ReduceOp::kMax}).wait();
  return secs.item<double>();
}

bool supported(const std::function<void()>& op) {
  try {
    op();  // also the warm-up
    op();
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median round times of `a` and `b`, alternating which goes first; nullopt where unsupported.
std::pair<std::optional<double>, std::optional<double>> compare(Env& env, int iters,
                                                                 const std::function<void()>& a,
                                                                 const std::function<void()>& b) {
  const bool has_a = supported(a), has_b = supported(b);
  std::vector<double> ta, tb;
  for (int round = 0; round < 7; ++round) {
    if (round % 2 == 0 && has_a) ta.push_back(time_round(env, iters, a));
    if (has_b) tb.push_back(time_round(env, iters, b));
    if (round % 2 == 1 && has_a) ta.push_back(time_round(env, iters, a));
  }
  return {has_a ? std::optional(median(ta)) : std::nullopt,
          has_b ? std::optional(median(tb)) : std::nullopt};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t max_mib = 64;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--max-mib") == 0) max_mib = std::atoll(argv[i + 1]);

  const auto le = dist::read_launch_env();
  Env env{dist::init_from_env(), {}};
  const int n = env.comm.size(), rank = env.comm.rank();
  {
    c10d::TCPStoreOptions so;
    so.port = le.master_port;
    so.isServer = false;
    auto store = c10::make_intrusive<c10d::TCPStore>(le.master_addr, so);
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    env.pg = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("bench-pg", store), rank, n, opts);
  }
  if (rank == 0) {
    std::cout << describe(probe_blas()) << "\n";
    std::cout << fmt::format("\n### world size {} (loopback, one process per rank)\n\n", n);
    std::cout << "| op | bytes | fsdpp algbw GB/s | fsdpp busbw GB/s | c10d Gloo algbw GB/s | "
                 "c10d Gloo busbw GB/s | busbw ratio |\n|---|---:|---:|---:|---:|---:|---:|\n";
  }
  for (const std::string op : {"all_gather", "reduce_scatter", "all_reduce"}) {
    const double bus = (op == "all_reduce" ? 2.0 : 1.0) * (n - 1) / n;
    for (int64_t bytes = 4 << 10; bytes <= (max_mib << 20); bytes *= 4) {
      const int64_t numel = bytes / 4, chunk = numel / n;
      const int iters = static_cast<int>(std::clamp<int64_t>((64LL << 20) / bytes, 3, 100));
      auto full = at::ones({chunk * n});
      auto part = at::ones({chunk});
      std::vector<at::Tensor> parts;
      for (int r = 0; r < n; ++r) parts.push_back(at::empty({chunk}));
      std::function<void()> ours, theirs;
      if (op == "all_gather") {
        ours = [&] { env.comm.all_gather(full, part).wait(); };
        theirs = [&] {
          std::vector<std::vector<at::Tensor>> out{parts};
          std::vector<at::Tensor> in{part};
          env.pg->allgather(out, in)->wait();
        };
      } else if (op == "reduce_scatter") {
        ours = [&] { env.comm.reduce_scatter(part, full).wait(); };
        theirs = [&] {
          std::vector<std::vector<at::Tensor>> in{parts};
          std::vector<at::Tensor> out{part};
          env.pg->reduce_scatter(out, in)->wait();
        };
      } else {
        ours = [&] { env.comm.all_reduce(full).wait(); };
        theirs = [&] {
          std::vector<at::Tensor> t{full};
          env.pg->allreduce(t)->wait();
        };
      }
      const auto [a, b] = compare(env, iters, ours, theirs);
      if (rank != 0) continue;
      const double size = static_cast<double>(chunk * n * 4);
      auto cell = [&](const std::optional<double>& t, double factor) {
        return t ? fmt::format("{:.3f}", size / *t / 1e9 * factor) : std::string("n/a");
      };
      std::cout << fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", op, chunk * n * 4,
                               cell(a, 1), cell(a, bus), cell(b, 1), cell(b, bus),
                               b ? fmt::format("{:.2f}", *b / *a) : std::string("n/a"));
    }
  }
  env.comm.barrier().wait();
  return 0;
}
