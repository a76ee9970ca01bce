// Binding a rank's threads to its share of the CPUs: the shares, and the masks the kernel reports
// for the calling thread and for threads that existed before. Lowering the computing threads'
// priority: the nice values the kernel reports for each.
#include <ATen/Parallel.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "fsdpp/base/cpu_binding.hpp"
#include "fsdpp/base/parallel.hpp"

using namespace fsdpp;

namespace {

int gettid_() { return static_cast<int>(syscall(SYS_gettid)); }

void set_mask(int tid, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  REQUIRE((sched_setaffinity(tid, sizeof(set), &set) == 0 || errno == ESRCH));  // ESRCH: it ended meanwhile
}

// A thread that waits until told to end, reporting its Linux thread id.
struct Idle {
  std::promise<int> tid;
  std::atomic<bool> stop{false};
  std::thread thread{[this] {
    tid.set_value(gettid_());
    while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }};
  ~Idle() {
    stop = true;
    thread.join();
  }
};

}  // namespace

TEST_CASE("cpu binding: shares are equal blocks of consecutive allowed CPUs") {
  CHECK(cpu_share({0, 1}, 0, 2) == std::vector<int>{0});
  CHECK(cpu_share({0, 1}, 1, 2) == std::vector<int>{1});
  CHECK(cpu_share({0, 1, 2, 3}, 1, 2) == std::vector<int>{2, 3});
  CHECK(cpu_share({4, 6, 9}, 1, 2) == std::vector<int>{6});  // the remainder (9) unused
  CHECK(cpu_share({0, 1, 2}, 0, 1) == std::vector<int>{0, 1, 2});
  CHECK(cpu_share({0}, 1, 2).empty());
  CHECK_THROWS_AS(cpu_share({0, 1}, 2, 2), std::invalid_argument);
  CHECK(parse_cpu_binding("compute") == CpuBinding::kCompute);
  CHECK_THROWS_WITH_AS(parse_cpu_binding("cores"), "cpu binding 'cores': expected none, rank or compute",
                       std::invalid_argument);
}

TEST_CASE("cpu binding: compute binds the calling thread only; rank binds every thread") {
  const auto all = allowed_cpus();
  REQUIRE(!all.empty());
  const int n = static_cast<int>(all.size());
  const int last = n - 1;  // the last CPU's share when each local rank gets one CPU
  Idle before;             // a thread that exists before the binding, like a communicator's worker
  const int before_tid = before.tid.get_future().get();
  const auto before_mask = thread_cpus(before_tid);

  std::string said;
  std::vector<int> own, others;
  std::thread([&] {
    said = bind_cpus(CpuBinding::kCompute, last, n);
    own = thread_cpus();
    others = thread_cpus(before_tid);
  }).join();
  CHECK(said == "compute thread on CPU " + std::to_string(all.back()));
  CHECK(own == std::vector<int>{all.back()});
  CHECK(others == before_mask);

  // More ranks than CPUs: nothing is bound, and the log says why.
  std::thread([&] {
    said = bind_cpus(CpuBinding::kCompute, 0, n + 1);
    own = thread_cpus();
  }).join();
  CHECK(said.find("not bound: " + std::to_string(n + 1) + " local ranks for") == 0);
  CHECK(own == thread_cpus(getpid()));
  CHECK(bind_cpus(CpuBinding::kNone, 0, 1).empty());

  // rank: every thread of the process, the one made before included; then every mask back.
  std::map<int, std::vector<int>> masks;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const int tid = std::stoi(e.path().filename().string());
    masks[tid] = thread_cpus(tid);
  }
  said = bind_cpus(CpuBinding::kRank, last, n);
  CHECK(said == "every thread on CPU " + std::to_string(all.back()));
  CHECK(thread_cpus() == std::vector<int>{all.back()});
  CHECK(thread_cpus(before_tid) == std::vector<int>{all.back()});
  for (const auto& [tid, mask] : masks) set_mask(tid, mask);
  CHECK(thread_cpus(before_tid) == before_mask);
}

TEST_CASE("compute nice: the calling thread and its intra-op threads yield; threads made before keep theirs") {
  const auto nice_of = [](int tid) {
    errno = 0;
    const int n = getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
    REQUIRE(errno == 0);
    return n;
  };
  CHECK_THROWS_WITH_AS(lower_compute_priority(20), "compute nice 20: expected 0 to 19", std::invalid_argument);
  CHECK_THROWS_AS(lower_compute_priority(-1), std::invalid_argument);

  Idle before;  // like a communicator's worker: it exists before the computing thread yields
  const int before_tid = before.tid.get_future().get();
  const int before_nice = nice_of(before_tid);
  const int threads = at::get_num_threads();
  // In a thread of its own, which owns its intra-op threads (OpenMP gives each thread that starts
  // a parallel region its own team), so that the test's other threads keep their priority.
  std::string said, unchanged;
  int own_before = 0, own_after = 0;
  std::map<int, int> pool;  // intra-op thread -> nice, read in a parallel region after the change
  std::mutex mu;
  std::thread([&] {
    at::set_num_threads(2);  // OpenMP's thread count is the calling thread's own setting
    own_before = nice_of(gettid_());
    // The intra-op threads exist before the change, as they do in a trainer that built its model.
    parallel_ranges(2, 1, [](int64_t, int64_t) {});
    unchanged = lower_compute_priority(0);
    said = lower_compute_priority(1);
    own_after = nice_of(gettid_());
    parallel_ranges(2, 1, [&](int64_t, int64_t) {
      const int tid = gettid_();
      const int n = nice_of(tid);
      std::lock_guard<std::mutex> lock(mu);
      pool[tid] = n;
    });
  }).join();
  at::set_num_threads(threads);
  CHECK(unchanged.empty());
  const int target = std::min(19, own_before + 1);
  CHECK(said == fmt::format("computing threads at nice {} (was {})", target, own_before));
  CHECK(own_after == target);
  CHECK(pool.size() == 2);  // the calling thread and one intra-op thread
  for (const auto& [tid, n] : pool) {
    CAPTURE(tid);
    CHECK(n == target);
  }
  CHECK(nice_of(before_tid) == before_nice);
}
