// A rank for the real-process tests, started under `fsdpp launch` (or by hand with torchrun's
// variables). Modes:
//   collectives         every operation, as the GPU rank program checks them (tests/gpu/collectives.hpp)
//                       on CPU tensors, then its captured sequence run eagerly
//   exit CODE RANK      RANK exits with CODE after init; the others block in a receive from it
//   kill RANK           RANK kills itself with SIGKILL; the others block likewise
//   sleep               every rank prints "ready" and sleeps (for Ctrl-C and orphan tests)
//   exit-first CODE RANK  on the group's first start, as exit; on a restart, as collectives
//   hang RANK           labelled all_gathers; RANK skips the second one (a fault to diagnose)
//   env [ask]           labelled all_gathers, rank 0 joining the third one a second late; with
//                       "ask", the program takes FSDPP_FAULT and the watchdog's settings from its
//                       environment as the CLI does, without it it asks for neither (and must see
//                       no effect of them)
// Extra arguments are ignored; tests pass a unique token to find stray processes afterwards.
// FSDPP_TEST_TIMEOUT_MS sets the rendezvous timeout.
#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "fsdpp/comm/fault.hpp"
#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/comm/init.hpp"
#include "gpu/collectives.hpp"

using namespace fsdpp;

namespace {

int fail(const std::string& what) {
  std::cerr << "FAILED: " << what << std::endl;
  return 1;
}

int collectives(comm::Comm& comm) {
  const int r = comm.rank(), n = comm.size();
  for (const auto& bad : test::check_collectives(comm, at::kCPU)) return fail(bad);
  auto t = at::arange(8 * n, at::kFloat).add(r);
  for (int i = 0; i < 3; ++i) test::round_trip(comm, t);
  comm.barrier().wait();
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
    // A test program lets its environment set the watchdog and faults, as the CLI does; the env
    // mode without "ask" is a program that does not.
    if (mode != "env" || (argc > 2 && std::string(argv[2]) == "ask")) {
      opts = comm::with_watchdog_from_env(opts);
      comm::arm_faults_from_env();
    }
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
    if (mode == "env") {
      for (int i = 0; i < 3; ++i) {
        if (i == 2 && comm.rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(1));
        comm::OpLabel label("fsdp all_gather layers." + std::to_string(i));
        auto out = at::zeros({comm.size() * 4});
        comm.all_gather(out, at::full({4}, comm.rank() + 1.0)).wait();
        // A skipped all_gather leaves its output as it was.
        if (!at::equal(out, at::arange(1, comm.size() + 1, at::kFloat).repeat_interleave(4)))
          return fail("all_gather " + std::to_string(i) + " did not gather");
      }
      comm.barrier().wait();
      std::cout << "rank " << comm.rank() << "/" << comm.size() << " env ok" << std::endl;
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
