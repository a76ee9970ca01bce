// A fresh process for tests/train/test_openmp_wait.cpp (libgomp reads GOMP_SPINCOUNT when it is
// loaded): a parallel region on ATen's two intra-op threads, then 50 ms with the main thread asleep,
// five times. Prints the process's CPU time during those sleeps in microseconds: what the idle
// worker thread spent spinning.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <thread>

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
  double spent = 0;
  for (int i = 0; i < 5; ++i) {
    x.add_(1.0);
    const double t0 = cpu_us();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    spent += cpu_us() - t0;
  }
  std::printf("%.0f\n", spent);
  return 0;
}
