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
// The thresholds must be in place before the process allocates: set through mallopt() once the
// trainer starts, they gave no measurable gain. So `fsdpp run` puts them into its ranks'
// environment (GLIBC_TUNABLES, which glibc reads before main), unless the recipe says
// dist.keep_freed_memory = false or the environment sets either threshold already.

#include <optional>
#include <string>

namespace fsdpp {

// Blocks up to 256 MiB from the heaps; up to 1 GiB of free space kept by each heap.
inline constexpr const char* kKeptMallocTunables =
    "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824";

// The variables through which glibc's malloc takes its thresholds; null where unset.
struct MallocEnvironment {
  const char* tunables = nullptr;        // GLIBC_TUNABLES: name=value[:name=value...]
  const char* mmap_threshold = nullptr;  // MALLOC_MMAP_THRESHOLD_, the older spelling
  const char* trim_threshold = nullptr;  // MALLOC_TRIM_THRESHOLD_
};

// This process's.
MallocEnvironment malloc_environment();

// The GLIBC_TUNABLES value that adds kKeptMallocTunables to what `env.tunables` holds, keeping
// every tunable there. nullopt when `env` sets malloc's mmap or trim threshold already, either
// way: those settings are left as they are.
std::optional<std::string> with_kept_malloc_thresholds(const MallocEnvironment& env);

// What `env` does to malloc's thresholds, for the log: "mmap threshold 256 MiB, trim threshold
// 1 GiB (GLIBC_TUNABLES)", "trim threshold 2 MiB (MALLOC_TRIM_THRESHOLD_)" or "malloc's own
// thresholds".
std::string describe_malloc_thresholds(const MallocEnvironment& env);

}  // namespace fsdpp
