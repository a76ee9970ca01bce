#pragma once
// Keeping freed host memory for the next step. glibc's malloc serves a block above its mmap
// threshold from a fresh mapping and gives free space above its trim threshold back to the system;
// it raises both as it sees large blocks freed, but no further than 32 MiB (trim: 64 MiB). A
// training step frees and allocates the same large blocks every step, and pays a page fault for
// each page of every block that comes fresh from the system. Thresholds set high from the start of
// the process keep those blocks in malloc's heaps: bench/results/host_memory.md measures it
// (moe-small at dp 1: 2,622 page faults a step down to 354, tokens/s 1.07x). The cost is that a
// process keeps its largest use of the heaps until it exits instead of returning what a step frees.
//
// A thread other than the main one allocates from an arena of its own, made of heaps of 64 MiB;
// when its use outgrows one heap and then shrinks (a microbatch thread's activations, freed at the
// end of each backward), malloc unmaps the emptied heaps whatever the trim threshold, unless the
// heap before has less room left than the top pad. A top pad of 64 MiB keeps them: with
// parallel.microbatch_threads=2, moe-small's second thread took about 2,200 page faults a step
// without it and next to none with it (bench/results/dp1_threads.md). The top pad also rounds up
// each growth of a heap; the address space reserved that way is not touched, so not resident.
//
// The settings must be in place before the process allocates: set through mallopt() once the
// trainer starts, they gave no measurable gain. So `fsdpp run` puts them into its ranks'
// environment (GLIBC_TUNABLES, which glibc reads before main), unless the recipe says
// dist.keep_freed_memory = false or the environment sets any of them already.

#include <optional>
#include <string>

namespace fsdpp {

// Blocks up to 256 MiB from the heaps; up to 1 GiB of free space kept by each heap; a thread's
// emptied heaps kept (a top pad of 64 MiB).
inline constexpr const char* kKeptMallocTunables =
    "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824:glibc.malloc.top_pad=67108864";

// The variables through which glibc's malloc takes its thresholds and top pad; null where unset.
struct MallocEnvironment {
  const char* tunables = nullptr;        // GLIBC_TUNABLES: name=value[:name=value...]
  const char* mmap_threshold = nullptr;  // MALLOC_MMAP_THRESHOLD_, the older spelling
  const char* trim_threshold = nullptr;  // MALLOC_TRIM_THRESHOLD_
  const char* top_pad = nullptr;         // MALLOC_TOP_PAD_
};

// This process's.
MallocEnvironment malloc_environment();

// The GLIBC_TUNABLES value that adds kKeptMallocTunables to what `env.tunables` holds, keeping
// every tunable there. nullopt when `env` sets malloc's mmap threshold, trim threshold or top pad
// already, either way: those settings are left as they are.
std::optional<std::string> with_kept_malloc_thresholds(const MallocEnvironment& env);

// What `env` does to malloc's thresholds and top pad, for the log: "mmap threshold 256 MiB, trim
// threshold 1 GiB, top pad 64 MiB (GLIBC_TUNABLES)", "trim threshold 2 MiB
// (MALLOC_TRIM_THRESHOLD_)" or "malloc's own thresholds".
std::string describe_malloc_thresholds(const MallocEnvironment& env);

}  // namespace fsdpp
