#include "fsdpp/base/cuda_graph.hpp"

#include <stdexcept>
#include <string>

#if FSDPP_WITH_NCCL
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace fsdpp {

struct CapturedStep::Impl {
  at::cuda::CUDAGraph graph;
};

namespace {

// Makes `waiter` wait for the work already on `producer` (an event, no host wait).
void order_after(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess)
    throw std::runtime_error("CUDA graph: cudaEventCreate failed");
  const bool ok = cudaEventRecord(e, producer.stream()) == cudaSuccess && cudaStreamWaitEvent(waiter.stream(), e, 0) == cudaSuccess;
  cudaEventDestroy(e);
  if (!ok) throw std::runtime_error("CUDA graph: ordering streams failed");
}

}  // namespace

std::unique_ptr<CapturedStep> CapturedStep::capture(const std::function<void()>& step) {
  auto impl = std::make_unique<Impl>();
  // Capture needs a stream other than the default one; the side stream starts after the work
  // already queued, and the caller's stream continues after the capture's (empty) work.
  const auto caller = c10::cuda::getCurrentCUDAStream();
  const auto side = c10::cuda::getStreamFromPool();
  order_after(side, caller);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    impl->graph.capture_begin();
    try {
      step();
    } catch (...) {
      try {
        impl->graph.capture_end();
      } catch (...) {
      }
      throw;
    }
    impl->graph.capture_end();
  }
  order_after(caller, side);
  return std::unique_ptr<CapturedStep>(new CapturedStep(std::move(impl)));
}

void CapturedStep::replay() { impl_->graph.replay(); }

int current_cuda_device() { return c10::cuda::current_device(); }

bool stream_capturing(int device) {
  const auto d = device < 0 ? c10::cuda::current_device() : static_cast<c10::DeviceIndex>(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(d).stream(), &status) == cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

}  // namespace fsdpp

#else

namespace fsdpp {

struct CapturedStep::Impl {};

std::unique_ptr<CapturedStep> CapturedStep::capture(const std::function<void()>&) {
  throw std::runtime_error("CUDA graph capture needs fsdpp built against a CUDA LibTorch (this build is CPU-only)");
}

void CapturedStep::replay() {}

bool stream_capturing(int) { return false; }

int current_cuda_device() {
  throw std::runtime_error("this fsdpp is built without CUDA (build against a CUDA LibTorch)");
}

}  // namespace fsdpp

#endif

namespace fsdpp {

CapturedStep::CapturedStep(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CapturedStep::~CapturedStep() = default;

}  // namespace fsdpp
