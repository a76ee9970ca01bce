#pragma once
// Where a rank's threads run on a machine whose local ranks share its CPUs. Each local rank gets an
// equal block of consecutive CPUs among those the process may use (its affinity mask, so taskset,
// cgroups and schedulers are respected), and binds either every thread it has (`kRank`) or only the
// thread that computes (`kCompute`): communication threads (the communicators' workers, Gloo's
// event loops) then stay free to run on whichever CPU is idle while this rank computes.
// bench/results/dp2_threads.md measures each choice at dp = 2 on 2 cores.

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace fsdpp {

enum class CpuBinding { kNone, kRank, kCompute };

// "none", "rank", "compute"; throws std::invalid_argument naming the choices otherwise.
CpuBinding parse_cpu_binding(const std::string& name);

// The CPUs this process may run on, ascending.
std::vector<int> allowed_cpus();

// Local rank `local_rank`'s block of `cpus` when `local_world` ranks share them: cpus.size() /
// local_world consecutive CPUs (the remainder unused). Empty when there are fewer CPUs than ranks.
std::vector<int> cpu_share(const std::vector<int>& cpus, int local_rank, int local_world);

// The CPUs a thread (a Linux thread id; 0: the calling thread) may run on, ascending.
std::vector<int> thread_cpus(int tid = 0);

// Applies `binding` for this local rank: kCompute binds the calling thread (threads it starts later,
// such as OpenMP's pool at the first parallel region, inherit the mask), kRank every thread of the
// process as well. Returns what was done, for the log: "compute thread on CPU 1", "not bound:
// 3 local ranks for 2 CPUs", "" for kNone. Throws std::runtime_error when the system refuses.
std::string bind_cpus(CpuBinding binding, int local_rank, int local_world);

// Lowers the computing threads' priority: adds `increment` (0 to 19) to the nice value of the
// calling thread and of each thread of ATen's intra-op pool, up to 19. The threads that exist
// already and are not these (the communicators' workers, Gloo's event loops) keep theirs, so on
// CPUs that the computing threads keep busy they run as soon as a transfer needs them rather than
// when a time slice ends. Call it once every communicator exists: threads the computing thread
// starts later inherit its nice value. Returns what was done, for the log ("" for 0). Throws
// std::invalid_argument outside 0..19 and std::runtime_error when the system refuses.
// bench/results/dp2_threads.md measures it at dp = 2 on 2 cores.
std::string lower_compute_priority(int increment);

// Puts the computing threads (the calling thread and ATen's intra-op threads, as
// lower_compute_priority chooses them) in Linux's SCHED_IDLE class. A thread of the normal class
// that wakes on a CPU where one of them runs takes that CPU at once, where a nice value only
// shortens the computing thread's share and leaves the woken thread to wait for the scheduler's
// next decision (up to a time slice): a communicator's worker or Gloo's event loop then moves its
// bytes as soon as they arrive. The computing threads still get every CPU cycle nobody else wants,
// and yield to every other process of the machine even more than at nice 19. Call it where
// lower_compute_priority would be called; threads the computing thread starts later inherit the
// class. Returns what was done, for the log. Throws std::runtime_error when the system refuses.
// bench/results/dp2_threads.md measures it at dp = 2 on 2 cores.
std::string make_compute_idle();

// Note [rotating CPUs]
// On a shared host (a virtual machine beside other tenants' work), one CPU often runs slower than
// another for a few hundred milliseconds at a time. Ranks bound each to its own CPU then drift
// apart within a step, and the first collective that needs both (the last reduce-scatter of a
// step) makes the one that is ahead wait: the step costs the slower CPU's time. CpuRotation moves
// local rank r's computing threads (the calling thread and ATen's intra-op pool) to share
// (r + k) mod local_world of `cpus` in period k, counting periods of the monotonic clock, which
// every process on the machine reads alike: the ranks change shares at the same instants and never
// share one, each spends equal time on every share, and a slow share slows them alike. Each move
// costs the moved thread its private caches, so the period is a trade-off
// (bench/results/cpu_rotation.md). `alternate` (0: off) rotates only in every other window of
// that length, each rank staying on its own share in between, so that one run's trace compares
// the two ways side by side. With one local rank, or fewer CPUs than local ranks, nothing moves.
// Stopping (the destructor) returns the threads to their own share.
class CpuRotation {
 public:
  CpuRotation(const std::vector<int>& cpus, int local_rank, int local_world, std::chrono::milliseconds period,
              std::chrono::milliseconds alternate = std::chrono::milliseconds(0));
  ~CpuRotation();
  CpuRotation(const CpuRotation&) = delete;
  CpuRotation& operator=(const CpuRotation&) = delete;
  // For the log: "1 computing thread, 2 shares, every 20 ms", or why nothing moves.
  const std::string& description() const { return description_; }
  bool rotating() const { return thread_.joinable(); }
  // Times the threads were placed so far (on starting, then once per period).
  int64_t moves() const { return moves_.load(); }

 private:
  void loop(int64_t next_ns);
  void place(const std::vector<int>& share);
  // Places the threads for the current period; returns when the next one starts (monotonic ns).
  int64_t place_now();
  int local_rank_, local_world_;
  int64_t period_ns_, alternate_ns_;
  std::vector<int> tids_;
  std::vector<std::vector<int>> shares_;
  std::string description_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> moves_{0};
  std::thread thread_;
};

}  // namespace fsdpp
