#pragma once
// How long LibTorch's idle OpenMP threads spin before they sleep, for cpu.microbatch_threads.
// GNU OpenMP (libgomp, LibTorch's on Linux) keeps a thread whose share of a parallel region is done
// spinning for GOMP_SPINCOUNT rounds before it sleeps, in case the next region starts soon:
// 300,000 rounds unless OMP_WAIT_POLICY is set, some milliseconds. With the microbatches on threads,
// the step's last parallel region before them leaves the main thread's intra-op worker spinning
// while the microbatch threads compute: three threads running on two cores, the slower microbatch
// thread, and so the step, late by what the worker took (bench/results/dp1_threads.md). 10,000
// rounds (about half a millisecond) still bridge the gaps between back-to-back regions.
//
// libgomp reads the variable once, when it is loaded, so `fsdpp run` puts GOMP_SPINCOUNT into its
// ranks' environment when the recipe sets cpu.microbatch_threads above 1, unless the
// environment sets GOMP_SPINCOUNT or OMP_WAIT_POLICY already.

#include <optional>
#include <string>

namespace fsdpp {

inline constexpr const char* kMicrobatchThreadsSpinCount = "10000";

// The variables through which libgomp takes its spin count; null where unset.
struct OpenMPWaitEnvironment {
  const char* spin_count = nullptr;   // GOMP_SPINCOUNT
  const char* wait_policy = nullptr;  // OMP_WAIT_POLICY
};

// This process's.
OpenMPWaitEnvironment openmp_wait_environment();

// The GOMP_SPINCOUNT value a rank of a run with `microbatch_threads` threads gets: kMicrobatchThreadsSpinCount
// for more than one thread; nullopt for one, or when `env` sets either variable (left as it is).
std::optional<std::string> microbatch_threads_spin_count(int microbatch_threads,
                                                         const OpenMPWaitEnvironment& env);

// What `env` does to idle OpenMP threads, for the log: "idle threads spin 10000 rounds, then sleep
// (GOMP_SPINCOUNT)", "OMP_WAIT_POLICY=passive" or "libgomp's own wait (300,000 spin rounds)".
std::string describe_openmp_wait(const OpenMPWaitEnvironment& env);

}  // namespace fsdpp
