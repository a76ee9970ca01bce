// main() of the test binaries that need a GPU. With a CUDA device every test case runs. Without one,
// only the test cases named "[no gpu] ..." run (they check the error paths a CPU machine can reach),
// and the binary then reports itself skipped, saying why (exit 77: ctest's SKIP_RETURN_CODE), so a
// machine without a GPU never counts these tests as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  doctest::Context context(argc, argv);
  if (err == cudaSuccess && devices > 0) {
    context.addFilter("test-case-exclude", "[no gpu]*");
    return context.run();
  }
  context.addFilter("test-case", "[no gpu]*");
  context.setOption("no-exitcode", false);
  const int rc = context.run();
  if (rc != 0 || context.shouldExit()) return rc;
  std::printf("skipped: no CUDA device here (cudaGetDeviceCount: %s); the GPU test cases did not run\n",
              err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
  return 77;
}
