// A rank for the real-process tests, started under `fsdpp launch` (or by hand with torchrun's
// variables). Modes:
//   collectives         check all_reduce, all_gather, reduce_scatter, send/recv across processes
//   exit CODE RANK      RANK exits with CODE after init; the others block in a receive from it
//   kill RANK           RANK kills itself with SIGKILL; the others block likewise
//   sleep               every rank prints "ready" and sleeps (for Ctrl-C and orphan tests)
//   exit-first CODE RANK  on the group's first start, as exit; on a restart, as collectives
//   hang RANK           labelled all_gathers; RANK skips the second one (a fault to diagnose)
// Extra arguments are ignored; tests pass a unique token to find stray processes afterwards.
// FSDPP_TEST_TIMEOUT_MS sets the rendezvous timeout.
#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/comm/init.hpp"

using namespace fsdpp;

namespace {

int fail(const std::string& what) {
  std::cerr << "FAILED: " << what << std::endl;
  return 1;
}

int collectives(comm::Comm& comm) {
  const int r = comm.rank(), n = comm.size();
  auto t = at::full({1000}, r + 1.0);
  comm.all_reduce(t).wait();
  if (!at::all(t == n * (n + 1) / 2.0).item<bool>()) return fail("all_reduce");
  auto g = at::empty({n * 3}, at::kLong);
  comm.all_gather(g, at::full({3}, r, at::kLong)).wait();
  if (!at::equal(g, at::arange(n, at::kLong).repeat_interleave(3))) return fail("all_gather");
  auto in = at::arange(n * 4, at::kFloat).to(at::kBFloat16), out = at::empty({4}, at::kBFloat16);
  comm.reduce_scatter(out, in).wait();
  if (!at::equal(out, (at::arange(4, at::kFloat) + 4 * r).mul(n).to(at::kBFloat16)))
    return fail("reduce_scatter");
  if (n > 1) {
    auto recv = at::empty({2}, at::kInt);
    auto w = comm.recv(recv, (r + n - 1) % n, 1);
    comm.send(at::full({2}, r, at::kInt), (r + 1) % n, 1).wait();
    w.wait();
    if (recv[0].item<int>() != (r + n - 1) % n) return fail("send/recv");
  }
  comm.barrier().wait();
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::cout << "rank " << r << "/" << n << " ok" << std::endl;
  return 0;
}

// Blocks in a receive from `peer`, which will never send.
void block_on(comm::Comm& comm, int peer) {
  auto t = at::empty({1});
  comm.recv(t, peer, 99).wait();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return fail("usage: fsdpp_test_rank MODE [ARGS]");
  const std::string mode = argv[1];
  comm::InitOptions opts;
  if (const char* ms = std::getenv("FSDPP_TEST_TIMEOUT_MS"))
    opts.timeout = std::chrono::milliseconds(std::atoi(ms));
  try {
    auto comm = comm::init_from_env(opts);
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const bool restarted = restart && std::atoi(restart) > 0;
    if (mode == "collectives" || (mode == "exit-first" && restarted)) {
      if (restarted) std::cout << "restart " << restart << ": ";
      return collectives(comm);
    }
    if (mode == "exit-first") {
      const int victim = std::atoi(argv[3]);
      comm.barrier().wait();
      if (comm.rank() == victim) {
        std::cout << "rank " << victim << " failing now" << std::endl;
        return std::atoi(argv[2]);
      }
      block_on(comm, victim);
      return 0;
    }
    if (mode == "exit" || mode == "kill") {
      const int victim = std::atoi(argv[mode == "exit" ? 3 : 2]);
      comm.barrier().wait();
      if (comm.rank() == victim) {
        std::cout << "rank " << victim << " failing now" << std::endl;
        if (mode == "kill") raise(SIGKILL);
        return std::atoi(argv[2]);
      }
      block_on(comm, victim);
      return 0;
    }
    if (mode == "hang") {
      const int skipper = std::atoi(argv[2]);
      for (int i = 0; i < 3; ++i) {
        if (i == 1 && comm.rank() == skipper) continue;
        comm::OpLabel label("fsdp all_gather layers." + std::to_string(i));
        auto out = at::empty({comm.size() * 4});
        comm.all_gather(out, at::ones({4})).wait();
      }
      comm.barrier().wait();
      return 0;
    }
    if (mode == "sleep") {
      comm.barrier().wait();
      std::cout << "ready" << std::endl;
      std::this_thread::sleep_for(std::chrono::minutes(10));
      return 0;
    }
    return fail("unknown mode " + mode);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }
}
