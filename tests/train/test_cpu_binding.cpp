// Binding a rank's threads to its share of the CPUs: the shares, and the masks the kernel reports
// for the calling thread and for threads that existed before. Lowering the computing threads'
// priority: the nice values and scheduling classes the kernel reports for each. Rotating the
// computing threads over the shares: the masks two local ranks' threads see over time.
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
#include <set>
#include <mutex>
#include <thread>
#include <time.h>

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

TEST_CASE("compute policy idle: the calling thread and its intra-op threads go to SCHED_IDLE; threads made before keep theirs") {
  Idle before;  // like a communicator's worker
  const int before_tid = before.tid.get_future().get();
  const int before_policy = sched_getscheduler(before_tid);
  REQUIRE(before_policy != SCHED_IDLE);
  const int threads = at::get_num_threads();
  std::string said;
  int own_before = -1, own_after = -1, later = -1;
  std::map<int, int> pool;  // intra-op thread -> policy, read in a parallel region after the change
  std::mutex mu;
  std::thread([&] {
    at::set_num_threads(2);
    own_before = sched_getscheduler(0);
    parallel_ranges(2, 1, [](int64_t, int64_t) {});  // the intra-op threads exist before the change
    said = make_compute_idle();
    own_after = sched_getscheduler(0);
    parallel_ranges(2, 1, [&](int64_t, int64_t) {
      const int policy = sched_getscheduler(0);
      std::lock_guard<std::mutex> lock(mu);
      pool[gettid_()] = policy;
    });
    std::thread([&] { later = sched_getscheduler(0); }).join();  // started after: inherits the class
  }).join();
  at::set_num_threads(threads);
  CHECK(said == "computing threads in SCHED_IDLE");
  CHECK(own_before == SCHED_OTHER);
  CHECK(own_after == SCHED_IDLE);
  CHECK(later == SCHED_IDLE);
  CHECK(pool.size() == 2);
  for (const auto& [tid, policy] : pool) {
    CAPTURE(tid);
    CHECK(policy == SCHED_IDLE);
  }
  CHECK(sched_getscheduler(before_tid) == before_policy);
}

namespace {

int64_t monotonic_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

// What one local rank's computing thread saw while rotating: its mask, sampled every 0.5 ms.
struct Seen {
  std::vector<std::pair<int64_t, std::vector<int>>> samples;  // (monotonic ns, mask)
  std::vector<int> after_stop;
  std::string description;
  int64_t moves = 0;
};

Seen rotate_and_watch(const std::vector<int>& cpus, int rank, int ranks, int period_ms, int alternate_ms, int watch_ms) {
  Seen seen;
  std::thread([&] {
    at::set_num_threads(1);  // this thread alone computes (OpenMP's count is per thread)
    {
      CpuRotation rotation(cpus, rank, ranks, std::chrono::milliseconds(period_ms), std::chrono::milliseconds(alternate_ms));
      seen.description = rotation.description();
      const int64_t end = monotonic_ns() + int64_t{watch_ms} * 1000000;
      while (monotonic_ns() < end) {
        const int64_t t = monotonic_ns();
        seen.samples.emplace_back(t, thread_cpus());
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
      seen.moves = rotation.moves();
    }
    seen.after_stop = thread_cpus();
  }).join();
  return seen;
}

// Within `margin` of a multiple of `every`: a sample there may see either side of a move.
bool near_edge(int64_t t, int64_t every, int64_t margin) {
  const int64_t into = t % every;
  return into < margin || every - into < margin;
}

}  // namespace

TEST_CASE("cpu rotation: two local ranks' computing threads change shares together, never share one, and go home "
          "when it stops") {
  CHECK_THROWS_AS(CpuRotation({0, 1}, 0, 2, std::chrono::milliseconds(0)), std::invalid_argument);
  {
    CpuRotation alone({0, 1}, 0, 1, std::chrono::milliseconds(10));
    CHECK(alone.description() == "not rotated: one local rank");
    CHECK(!alone.rotating());
  }
  const auto all = allowed_cpus();
  if (all.size() < 2) {
    CpuRotation crowded(all, 0, 2, std::chrono::milliseconds(10));
    CHECK(crowded.description() == "not rotated: 2 local ranks for 1 CPU");
    CHECK(!crowded.rotating());
    MESSAGE("not checked here: the rotation itself, which needs 2 CPUs; this machine lets the tests use " << all.size());
    return;
  }
  const std::vector<std::vector<int>> shares{cpu_share(all, 0, 2), cpu_share(all, 1, 2)};
  const int period_ms = 10;
  const int64_t period = int64_t{period_ms} * 1000000, margin = 2000000;
  // Both local ranks at once, as two processes would run them.
  Seen seen[2];
  {
    std::thread other([&] { seen[1] = rotate_and_watch(all, 1, 2, period_ms, 0, 300); });
    seen[0] = rotate_and_watch(all, 0, 2, period_ms, 0, 300);
    other.join();
  }
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(seen[r].description == "1 computing thread, 2 shares, every 10 ms");
    CHECK(seen[r].moves >= 20);  // once a period, 30 periods
    // Away from the edges of the periods, rank r is on share (r + k) mod 2 in period k. A wake-up
    // late by more than the margin (a loaded machine) may put a few samples on the other side.
    int agree = 0, counted = 0;
    std::set<std::vector<int>> visited;
    for (const auto& [t, mask] : seen[r].samples) {
      visited.insert(mask);
      if (near_edge(t, period, margin)) continue;
      ++counted;
      agree += mask == shares[static_cast<size_t>((r + t / period) % 2)];
    }
    REQUIRE(counted > 100);
    CHECK(agree >= counted * 9 / 10);
    CHECK(visited == std::set<std::vector<int>>(shares.begin(), shares.end()));
    CHECK(seen[r].after_stop == shares[static_cast<size_t>(r)]);
  }

  // Alternating: in every other window of 60 ms rank 1 stays on its own share; it rotates in the rest.
  const int64_t window = 60000000;
  const Seen alt = rotate_and_watch(all, 1, 2, 5, 60, 360);
  CHECK(alt.description == "1 computing thread, 2 shares, every 5 ms (only in every other 60 ms window)");
  int home = 0, fixed = 0;
  std::set<std::vector<int>> rotating;
  for (const auto& [t, mask] : alt.samples) {
    if (near_edge(t, window, margin) || near_edge(t, 5000000, 1000000)) continue;
    if ((t / window) % 2 == 1) {
      ++fixed;
      home += mask == shares[1];
    } else {
      rotating.insert(mask);
    }
  }
  REQUIRE(fixed > 100);
  CHECK(home >= fixed * 9 / 10);
  CHECK(rotating.size() == 2);
}
