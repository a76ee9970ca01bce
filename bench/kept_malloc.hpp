#pragma once
// Benches that time what a training step allocates run with malloc's thresholds as `fsdpp run`
// gives its ranks (dist.keep_freed_memory, fsdpp/base/host_memory.hpp), so that tensors come from
// the heap as they do in training, not from fresh pages. GLIBC_TUNABLES is read when a process
// starts, so the bench starts itself again with them.
#include <fmt/format.h>

#include <unistd.h>

#include <cstdlib>

#include "fsdpp/base/host_memory.hpp"

namespace fsdpp::bench {

// Starts this program again with the kept thresholds added to GLIBC_TUNABLES, unless the
// environment sets malloc's thresholds already (then returns, and the bench runs under those). On
// failure to start again, says so and exits with status 1.
inline void restart_with_kept_malloc_thresholds(char** argv, const char* program) {
  const auto tunables = with_kept_malloc_thresholds(malloc_environment());
  if (!tunables) return;
  setenv("GLIBC_TUNABLES", tunables->c_str(), 1);
  execv("/proc/self/exe", argv);
  fmt::print(stderr, "{}: cannot start itself again with GLIBC_TUNABLES={}\n", program, *tunables);
  std::exit(1);
}

}  // namespace fsdpp::bench
