#include "fsdpp/base/openmp_wait.hpp"

#include <fmt/format.h>

#include <cstdlib>

namespace fsdpp {
namespace {

bool set(const char* v) { return v && *v; }

}  // namespace

OpenMPWaitEnvironment openmp_wait_environment() {
  return {std::getenv("GOMP_SPINCOUNT"), std::getenv("OMP_WAIT_POLICY")};
}

std::optional<std::string> microbatch_threads_spin_count(int microbatch_threads,
                                                         const OpenMPWaitEnvironment& env) {
  if (microbatch_threads <= 1 || set(env.spin_count) || set(env.wait_policy)) return std::nullopt;
  return std::string(kMicrobatchThreadsSpinCount);
}

std::string describe_openmp_wait(const OpenMPWaitEnvironment& env) {
  if (set(env.spin_count)) {
    std::string what = fmt::format("idle threads spin {} rounds, then sleep (GOMP_SPINCOUNT", env.spin_count);
    if (set(env.wait_policy)) what += fmt::format("; OMP_WAIT_POLICY={}", env.wait_policy);
    return what + ")";
  }
  if (set(env.wait_policy)) return fmt::format("OMP_WAIT_POLICY={}", env.wait_policy);
  return "libgomp's own wait (300,000 spin rounds)";
}

}  // namespace fsdpp
