// Keeping freed host memory (fsdpp/base/host_memory.hpp): the GLIBC_TUNABLES value `fsdpp run`
// gives its ranks, and what glibc does with it in a process started with it.
#include <doctest/doctest.h>

#include <string>

#include "fsdpp/base/host_memory.hpp"
#include "train/probe.hpp"

using namespace fsdpp;

namespace {

// Page faults of reallocating a freed 48 MiB block in a fresh process, or with `how` = "thread"
// 160 freed blocks of 1 MiB on a thread of the process (that thread's faults); `tunables` as
// GLIBC_TUNABLES (empty: unset).
long refill_faults(const std::string& tunables, const std::string& how = "") {
  return std::stol(test::probe_output(
      (tunables.empty() ? std::string("env -u GLIBC_TUNABLES ") : "env GLIBC_TUNABLES='" + tunables + "' ") +
      FSDPP_MALLOC_PROBE_BIN + " " + how));
}

}  // namespace

TEST_CASE("host memory: the kept thresholds join what GLIBC_TUNABLES holds, and never replace a threshold set there") {
  const auto with = [](const char* tunables, const char* mmap = nullptr, const char* trim = nullptr,
                       const char* top_pad = nullptr) {
    return with_kept_malloc_thresholds(MallocEnvironment{tunables, mmap, trim, top_pad});
  };
  const std::string kept = kKeptMallocTunables;
  CHECK(with(nullptr) == kept);
  CHECK(with("") == kept);
  CHECK(with("glibc.cpu.x86_rep_movsb_threshold=4096") == "glibc.cpu.x86_rep_movsb_threshold=4096:" + kept);
  CHECK(!with("glibc.malloc.trim_threshold=0").has_value());
  CHECK(!with("glibc.cpu.hwcaps=-AVX2:glibc.malloc.mmap_threshold=65536").has_value());
  CHECK(!with(nullptr, "65536").has_value());  // the older variables set them too
  CHECK(!with("glibc.malloc.arena_max=2", nullptr, "0").has_value());
  CHECK(!with("glibc.malloc.top_pad=0").has_value());  // the top pad is kept as set too
  CHECK(!with(nullptr, nullptr, nullptr, "4096").has_value());
  // Another malloc tunable is not a threshold.
  CHECK(with("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:" + kept);

  const auto describe = [](const char* tunables, const char* mmap = nullptr, const char* trim = nullptr,
                           const char* top_pad = nullptr) {
    return describe_malloc_thresholds(MallocEnvironment{tunables, mmap, trim, top_pad});
  };
  CHECK(describe(nullptr) == "malloc's own thresholds");
  CHECK(describe("glibc.malloc.arena_max=2") == "malloc's own thresholds");
  CHECK(describe(kKeptMallocTunables) ==
        "mmap threshold 256 MiB, trim threshold 1 GiB, top pad 64 MiB (GLIBC_TUNABLES)");
  CHECK(describe(nullptr, nullptr, nullptr, "131072") == "top pad 131072 bytes (MALLOC_TOP_PAD_)");
  CHECK(describe("glibc.malloc.trim_threshold=3000") == "trim threshold 3000 bytes (GLIBC_TUNABLES)");
  CHECK(describe("glibc.malloc.mmap_threshold=1048576", nullptr, "0x100") ==
        "mmap threshold 1 MiB, trim threshold 0x100 (GLIBC_TUNABLES, MALLOC_TRIM_THRESHOLD_)");
}

TEST_CASE("host memory: a process started with the kept thresholds reuses a freed 48 MiB block; with malloc's own it faults every page in again") {
  const long own = refill_faults(""), kept = refill_faults(kKeptMallocTunables);
  CAPTURE(own);
  CAPTURE(kept);
  // Mapped afresh: a fault for each 4 KiB page (12,288), or for each 2 MiB one where the system
  // backs anonymous memory with huge pages (24). Kept: the same block back from the heap.
  CHECK(own >= 10 * (kept + 1));
}

TEST_CASE("host memory: a thread whose arena outgrew a heap gets its memory back without faults with the kept settings; with the thresholds alone malloc unmaps the emptied heaps") {
  const long thresholds = refill_faults("glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824", "thread");
  const long kept = refill_faults(kKeptMallocTunables, "thread");
  CAPTURE(thresholds);
  CAPTURE(kept);
  // The thread's arena spans three 64 MiB heaps at its peak; without the top pad the two emptied
  // ones are unmapped and the second round faults their pages in again (about 24,800 of 4 KiB).
  CHECK(thresholds >= 10 * (kept + 1));
}
