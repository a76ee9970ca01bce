#pragma once
// Where a rank's threads run on a machine whose local ranks share its CPUs. Each local rank gets an
// equal block of consecutive CPUs among those the process may use (its affinity mask, so taskset,
// cgroups and schedulers are respected), and binds either every thread it has (`kRank`) or only the
// thread that computes (`kCompute`): communication threads (the communicators' workers, Gloo's
// event loops) then stay free to run on whichever CPU is idle while this rank computes.
// bench/results/dp2_threads.md measures each choice at dp = 2 on 2 cores.

#include <string>
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

}  // namespace fsdpp
