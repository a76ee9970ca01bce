// Minor page faults of allocating and filling memory a second time, after freeing it the first;
// printed for train/test_host_memory.cpp, which starts this program with and without
// GLIBC_TUNABLES (read by glibc before main, so it needs a process of its own). Without an
// argument: one 48 MiB block on the main thread. With `thread`: 160 blocks of 1 MiB on a thread of
// its own, whose arena outgrows its first 64 MiB heap, all freed, then allocated again; the faults
// counted are that thread's own.
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

long minor_faults(int who) {
  rusage u{};
  getrusage(who, &u);
  return u.ru_minflt;
}

char* filled(size_t bytes) {
  auto* p = static_cast<char*>(std::malloc(bytes));
  if (!p) std::exit(2);
  std::memset(p, 1, bytes);
  asm volatile("" : : "r"(p) : "memory");  // keep the compiler from eliding the block
  return p;
}

void fill(int count, size_t bytes) {
  std::vector<char*> blocks;
  for (int i = 0; i < count; ++i) blocks.push_back(filled(bytes));
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) std::free(*it);
}

}  // namespace

int main(int argc, char** argv) {
  long faults = 0;
  if (argc > 1 && std::string(argv[1]) == "thread") {
    std::thread([&] {
      fill(160, size_t(1) << 20);
      const long before = minor_faults(RUSAGE_THREAD);
      fill(160, size_t(1) << 20);
      faults = minor_faults(RUSAGE_THREAD) - before;
    }).join();
  } else {
    fill(1, size_t(48) << 20);
    const long before = minor_faults(RUSAGE_SELF);
    fill(1, size_t(48) << 20);
    faults = minor_faults(RUSAGE_SELF) - before;
  }
  std::printf("%ld\n", faults);
  return 0;
}
