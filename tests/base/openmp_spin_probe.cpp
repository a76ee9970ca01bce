// A fresh process for tests/base/test_openmp_wait.cpp (libgomp reads GOMP_SPINCOUNT when it is
// loaded): a parallel region on ATen's two intra-op threads, then 50 ms with the main thread asleep,
// five times. Prints the process's CPU time during those sleeps in microseconds, what the idle
// worker thread spent spinning: five times the middle sleep's, so that one sleep the machine
// disturbed (another process, the host) does not stand for all five.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <thread>
#include <vector>

namespace {

double cpu_us() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e6 + double(t.tv_nsec) / 1e3;
}

}  // namespace

int main() {
  at::set_num_threads(2);
  auto x = at::ones({int64_t(1) << 22});
  x.add_(1.0);  // the worker thread starts here
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::vector<double> spent;
  for (int i = 0; i < 5; ++i) {
    x.add_(1.0);
    const double t0 = cpu_us();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    spent.push_back(cpu_us() - t0);
  }
  std::nth_element(spent.begin(), spent.begin() + 2, spent.end());
  std::printf("%.0f\n", 5 * spent[2]);
  return 0;
}
