#include "fsdpp/base/cpu_binding.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ATen/Parallel.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>

#include "fsdpp/base/parallel.hpp"

namespace fsdpp {

namespace {

pid_t current_tid() { return static_cast<pid_t>(syscall(SYS_gettid)); }

std::vector<int> cpus_of(const cpu_set_t& set) {
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

void set_thread_cpus(pid_t tid, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  // ESRCH: the thread ended meanwhile.
  if (sched_setaffinity(tid, sizeof(set), &set) != 0 && errno != ESRCH)
    throw std::runtime_error(fmt::format("cpu binding: sched_setaffinity of thread {} to CPUs {} failed: {}", tid,
                                         fmt::join(cpus, ","), std::strerror(errno)));
}

// The threads that compute when the calling thread does: itself, then each thread of ATen's
// intra-op pool (one index per thread: ATen hands each thread one when the grain is 1).
std::vector<int> computing_threads() {
  std::vector<int> tids{current_tid()};
  std::mutex m;
  parallel_ranges(at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int tid = current_tid();
    std::lock_guard<std::mutex> lock(m);
    if (std::find(tids.begin(), tids.end(), tid) == tids.end()) tids.push_back(tid);
  });
  return tids;
}

// "CPU 1", "CPUs 2-3", "CPUs 0,2"
std::string describe(const std::vector<int>& cpus) {
  if (cpus.size() == 1) return fmt::format("CPU {}", cpus.front());
  if (cpus.back() - cpus.front() + 1 == static_cast<int>(cpus.size()))
    return fmt::format("CPUs {}-{}", cpus.front(), cpus.back());
  return fmt::format("CPUs {}", fmt::join(cpus, ","));
}

}  // namespace

CpuBinding parse_cpu_binding(const std::string& name) {
  if (name == "none") return CpuBinding::kNone;
  if (name == "rank") return CpuBinding::kRank;
  if (name == "compute") return CpuBinding::kCompute;
  throw std::invalid_argument(fmt::format("cpu binding '{}': expected none, rank or compute", name));
}

std::vector<int> thread_cpus(int tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(tid, sizeof(set), &set) != 0)
    throw std::runtime_error(fmt::format("cpu binding: sched_getaffinity of thread {} failed: {}", tid, std::strerror(errno)));
  return cpus_of(set);
}

std::vector<int> allowed_cpus() { return thread_cpus(getpid()); }

std::vector<int> cpu_share(const std::vector<int>& cpus, int local_rank, int local_world) {
  if (local_world < 1 || local_rank < 0 || local_rank >= local_world)
    throw std::invalid_argument(fmt::format("cpu_share: local rank {} of {}", local_rank, local_world));
  const size_t per = cpus.size() / static_cast<size_t>(local_world);
  if (per == 0) return {};
  return {cpus.begin() + static_cast<std::ptrdiff_t>(per * local_rank),
          cpus.begin() + static_cast<std::ptrdiff_t>(per * (local_rank + 1))};
}

std::string bind_cpus(CpuBinding binding, int local_rank, int local_world) {
  if (binding == CpuBinding::kNone) return "";
  const auto cpus = allowed_cpus();
  const auto share = cpu_share(cpus, local_rank, local_world);
  if (share.empty())
    return fmt::format("not bound: {} local ranks for {} CPU{}", local_world, cpus.size(), cpus.size() == 1 ? "" : "s");
  if (binding == CpuBinding::kRank) {
    // Every thread there is now; the threads they start later inherit the mask.
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task"))
      set_thread_cpus(std::stoi(entry.path().filename().string()), share);
    return fmt::format("every thread on {}", describe(share));
  }
  set_thread_cpus(current_tid(), share);
  return fmt::format("compute thread on {}", describe(share));
}

std::string lower_compute_priority(int increment) {
  if (increment < 0 || increment > 19)
    throw std::invalid_argument(fmt::format("compute nice {}: expected 0 to 19", increment));
  if (increment == 0) return "";
  errno = 0;
  const int before = getpriority(PRIO_PROCESS, current_tid());
  if (before == -1 && errno != 0)
    throw std::runtime_error(fmt::format("compute nice: getpriority failed: {}", std::strerror(errno)));
  const int target = std::min(19, before + increment);
  // A thread's nice value is its own on Linux: each computing thread is set by its id.
  const auto tids = computing_threads();
  for (const int tid : tids)
    if (getpriority(PRIO_PROCESS, static_cast<id_t>(tid)) < target &&
        setpriority(PRIO_PROCESS, static_cast<id_t>(tid), target) != 0 && errno != ESRCH)
      throw std::runtime_error(fmt::format("compute nice: setpriority of thread {} to {} failed: {}", tid, target,
                                           std::strerror(errno)));
  return fmt::format("computing thread{} at nice {} (was {})", tids.size() > 1 ? "s" : "", target, before);
}

std::string make_compute_idle() {
  const auto tids = computing_threads();
  const sched_param param{};  // SCHED_IDLE's only static priority is 0
  for (const int tid : tids)
    if (sched_setscheduler(static_cast<pid_t>(tid), SCHED_IDLE, &param) != 0 && errno != ESRCH)
      throw std::runtime_error(fmt::format("compute policy idle: sched_setscheduler of thread {} to SCHED_IDLE failed: {}",
                                           tid, std::strerror(errno)));
  return fmt::format("computing thread{} in SCHED_IDLE", tids.size() > 1 ? "s" : "");
}

CpuRotation::CpuRotation(const std::vector<int>& cpus, int local_rank, int local_world,
                         std::chrono::milliseconds period, std::chrono::milliseconds alternate)
    : local_rank_(local_rank),
      local_world_(local_world),
      period_ns_(std::chrono::nanoseconds(period).count()),
      alternate_ns_(std::chrono::nanoseconds(alternate).count()) {
  if (period.count() <= 0 || alternate.count() < 0)
    throw std::invalid_argument(fmt::format("cpu rotation: period {} ms must be positive and alternate {} ms not negative",
                                            period.count(), alternate.count()));
  for (int r = 0; r < local_world; ++r) shares_.push_back(cpu_share(cpus, r, local_world));
  if (local_world < 2) {
    description_ = "not rotated: one local rank";
    return;
  }
  if (shares_.front().empty()) {
    description_ = fmt::format("not rotated: {} local ranks for {} CPU{}", local_world, cpus.size(), cpus.size() == 1 ? "" : "s");
    return;
  }
  tids_ = computing_threads();
  description_ = fmt::format("{} computing thread{}, {} shares, every {} ms{}", tids_.size(), tids_.size() == 1 ? "" : "s",
                             local_world, period.count(),
                             alternate.count() > 0 ? fmt::format(" (only in every other {} ms window)", alternate.count()) : "");
  const int64_t next = place_now();  // placed before the constructor returns
  thread_ = std::thread([this, cpus, next] {
    // Woken once a period on whichever CPU is free, not on the share it was started from.
    set_thread_cpus(current_tid(), cpus);
    loop(next);
  });
}

CpuRotation::~CpuRotation() {
  if (!thread_.joinable()) return;
  stop_ = true;
  thread_.join();
  try {
    place(shares_[static_cast<size_t>(local_rank_)]);
  } catch (const std::exception&) {  // the threads keep the last share
  }
}

void CpuRotation::place(const std::vector<int>& share) {
  for (int tid : tids_) set_thread_cpus(tid, share);
}

int64_t CpuRotation::place_now() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  const int64_t t = int64_t{now.tv_sec} * 1000000000 + now.tv_nsec;
  const int64_t k = t / period_ns_;
  const bool fixed = alternate_ns_ > 0 && (t / alternate_ns_) % 2 == 1;
  place(shares_[static_cast<size_t>((local_rank_ + (fixed ? 0 : k)) % local_world_)]);
  ++moves_;
  return (k + 1) * period_ns_;
}

void CpuRotation::loop(int64_t next) {
  try {
    while (true) {
      const timespec at{static_cast<time_t>(next / 1000000000), static_cast<long>(next % 1000000000)};
      while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, nullptr) == EINTR) {
      }
      if (stop_.load()) return;
      next = place_now();
    }
  } catch (const std::exception& e) {
    // The CPUs this process may use changed under it: training goes on where the threads are.
    fmt::print(stderr, "cpu rotation stopped: {}\n", e.what());
  }
}

}  // namespace fsdpp
