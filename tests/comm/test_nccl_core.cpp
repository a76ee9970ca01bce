// The NCCL backend's core (src/comm/nccl/nccl_core.hpp), which builds with the CUDA runtime and NCCL
// alone. On a machine with a GPU: collectives on one rank, checked element by element after copying
// back. Without one (tests/gpu/gpu_main.cpp): creating a communicator fails with an error that names
// the rank, the step and CUDA's own message (the error path every NCCL and CUDA call goes through),
// and the test reports itself skipped.
#include <doctest/doctest.h>

#include <map>
#include <vector>

#include "../../src/comm/nccl/nccl_core.hpp"

using namespace fsdpp::comm::nccl;

namespace {

Rendezvous in_memory() {
  auto kv = std::make_shared<std::map<std::string, std::vector<uint8_t>>>();
  return {[kv](const std::string& k, const std::vector<uint8_t>& v) { (*kv)[k] = v; },
          [kv](const std::string& k) { return kv->at(k); }};
}

std::vector<float> to_host(const void* d, size_t n) {
  std::vector<float> h(n);
  REQUIRE(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

}  // namespace

TEST_CASE("[no gpu] nccl core: creating a communicator fails naming the rank, the step and CUDA's error") {
  std::string err;
  try {
    Core core(0, 1, 0, in_memory(), "id");
  } catch (const NcclError& e) {
    err = e.what();
  }
  CHECK(err.rfind("rank 0/1 cudaSetDevice: CUDA error '", 0) == 0);
}

// Note [captured operations]: what only a GPU run proves is that captured operations get no query
// at all and that the watchdog leaves a communicator alone after a capture (tests/gpu/test_gpu.cpp);
// the classification every query goes through is checked here, on any machine.
TEST_CASE("[no gpu] nccl core: a captured event counts as done, not as a device failure") {
  CHECK(completion_of(cudaSuccess, false, ncclSuccess) == Completion::kDone);
  CHECK(completion_of(cudaErrorCapturedEvent, false, ncclSuccess) == Completion::kDone);
  CHECK(completion_of(cudaErrorNotReady, false, ncclSuccess) == Completion::kInFlight);
  // A non-blocking communicator finishing a call in the background (Note [non-blocking
  // communicators]): the watchdog's query must not take it for a failure and abort.
  CHECK(completion_of(cudaErrorNotReady, false, ncclInProgress) == Completion::kInFlight);
  CHECK(completion_of(cudaSuccess, false, ncclInProgress) == Completion::kDone);
  // Not ready, but the communicator was aborted or NCCL failed: it will never complete.
  CHECK(completion_of(cudaErrorNotReady, true, ncclSuccess) == Completion::kFailed);
  CHECK(completion_of(cudaErrorNotReady, false, ncclRemoteError) == Completion::kFailed);
  // A real device error fails the operation.
  for (const auto e : {cudaErrorLaunchFailure, cudaErrorIllegalAddress, cudaErrorStreamCaptureInvalidated})
    CHECK(completion_of(e, false, ncclSuccess) == Completion::kFailed);
}

TEST_CASE("[no gpu] nccl core: a stream that cannot be asked does not count as capturing") {
  CHECK_FALSE(capturing(nullptr));  // without a device, cudaStreamIsCapturing fails
}

TEST_CASE("nccl core: a stream counts as capturing exactly while a capture records it") {
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  CHECK_FALSE(capturing(s));
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(capturing(s));
  cudaGraph_t g = nullptr;
  REQUIRE(cudaStreamEndCapture(s, &g) == cudaSuccess);
  CHECK_FALSE(capturing(s));
  if (g) cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("nccl core: collectives on one rank, checked after copying back") {
  Core core(0, 1, 0, in_memory(), "id");
  const size_t n = 5;
  float* a = nullptr;
  float* b = nullptr;
  REQUIRE(cudaMalloc(&a, n * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&b, n * sizeof(float)) == cudaSuccess);
  const std::vector<float> x = {1, 2, 3, 4, 5};
  REQUIRE(cudaMemcpy(a, x.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  auto e = core.all_reduce(a, b, n, ncclFloat32, ncclSum, nullptr);
  REQUIRE(cudaEventSynchronize(e.get()) == cudaSuccess);
  CHECK(to_host(b, n) == x);
  e = core.all_gather(a, b, n, ncclFloat32, nullptr);
  e = core.reduce_scatter(b, a, n, ncclFloat32, ncclAvg, e.get());
  REQUIRE(cudaEventSynchronize(e.get()) == cudaSuccess);
  CHECK(to_host(a, n) == x);
  REQUIRE(cudaEventSynchronize(core.barrier().get()) == cudaSuccess);
  auto child = core.split(0, 0);
  REQUIRE(child);
  CHECK(child->size() == 1);
  CHECK(core.split(-1, 0) == nullptr);
  cudaFree(a);
  cudaFree(b);
}
