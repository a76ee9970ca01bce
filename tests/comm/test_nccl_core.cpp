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
