// Minor page faults of allocating and filling a 48 MiB block a second time, after freeing the
// first; printed for train/test_host_memory.cpp, which starts this program with and without
// GLIBC_TUNABLES (read by glibc before main, so it needs a process of its own).
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

void fill(size_t bytes) {
  auto* p = static_cast<char*>(std::malloc(bytes));
  if (!p) std::exit(2);
  std::memset(p, 1, bytes);
  asm volatile("" : : "r"(p) : "memory");  // keep the compiler from eliding the block
  std::free(p);
}

}  // namespace

int main() {
  const size_t bytes = size_t(48) << 20;
  fill(bytes);
  const long before = minor_faults();
  fill(bytes);
  std::printf("%ld\n", minor_faults() - before);
  return 0;
}
