// Keeping freed host memory (fsdpp/base/host_memory.hpp): the GLIBC_TUNABLES value `fsdpp run`
// gives its ranks, and what glibc does with it in a process started with it.
#include <doctest/doctest.h>

#include <string>

#include "fsdpp/base/host_memory.hpp"
#include "train/probe.hpp"

using namespace fsdpp;

namespace {

// Page faults of reallocating a freed 48 MiB block in a fresh process; `tunables` as GLIBC_TUNABLES
// (empty: unset).
long refill_faults(const std::string& tunables) {
  return std::stol(test::probe_output(
      (tunables.empty() ? std::string("env -u GLIBC_TUNABLES ") : "env GLIBC_TUNABLES='" + tunables + "' ") +
      FSDPP_MALLOC_PROBE_BIN));
}

}  // namespace

TEST_CASE("host memory: the kept thresholds join what GLIBC_TUNABLES holds, and never replace a threshold set there") {
  const auto with = [](const char* tunables, const char* mmap = nullptr, const char* trim = nullptr) {
    return with_kept_malloc_thresholds(MallocEnvironment{tunables, mmap, trim});
  };
  const std::string kept = kKeptMallocTunables;
  CHECK(with(nullptr) == kept);
  CHECK(with("") == kept);
  CHECK(with("glibc.cpu.x86_rep_movsb_threshold=4096") == "glibc.cpu.x86_rep_movsb_threshold=4096:" + kept);
  CHECK(!with("glibc.malloc.trim_threshold=0").has_value());
  CHECK(!with("glibc.cpu.hwcaps=-AVX2:glibc.malloc.mmap_threshold=65536").has_value());
  CHECK(!with(nullptr, "65536").has_value());  // the older variables set them too
  CHECK(!with("glibc.malloc.arena_max=2", nullptr, "0").has_value());
  // Another malloc tunable is not a threshold.
  CHECK(with("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:" + kept);

  const auto describe = [](const char* tunables, const char* mmap = nullptr, const char* trim = nullptr) {
    return describe_malloc_thresholds(MallocEnvironment{tunables, mmap, trim});
  };
  CHECK(describe(nullptr) == "malloc's own thresholds");
  CHECK(describe("glibc.malloc.arena_max=2") == "malloc's own thresholds");
  CHECK(describe(kKeptMallocTunables) == "mmap threshold 256 MiB, trim threshold 1 GiB (GLIBC_TUNABLES)");
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
