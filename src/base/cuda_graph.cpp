#include "fsdpp/base/cuda_graph.hpp"

#include <stdexcept>
#include <string>

#if FSDPP_WITH_NCCL
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <mutex>
#include <optional>
#include <vector>

namespace fsdpp {

namespace {

// A generator state that a failed capture left in capture mode, put back: LibTorch 2.11 marks it
// capturing at capture_begin and unmarks it only in a capture_end that succeeds, so afterwards every
// eager random op would draw from the dead graph's offsets (and setting a seed would throw); 2.15
// keeps a state per capture instead, which is dropped here. Which one this LibTorch has is told
// from the type's members.
template <typename State, typename Id>
void end_capture_mode(State& state, Id capture_id) {
  if constexpr (requires { state.capturing_ = false; }) {
    state.capturing_ = false;
  } else if constexpr (requires { state.capture_states_.erase(capture_id); }) {
    std::lock_guard<std::mutex> lock(state.capture_states_mutex_);
    state.capture_states_.erase(capture_id);
  }
}

// LibTorch's graph, with the generator states its capture registered within reach.
struct Graph : at::cuda::CUDAGraph {
  void end_generators_capture() {
    for (auto& [state, increment] : captured_generator_states_) end_capture_mode(*state, capture_id_);
  }
};

}  // namespace

struct CapturedStep::Impl {
  std::unique_ptr<Graph> graph = std::make_unique<Graph>();
};

namespace {

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const bool asked = cudaStreamIsCapturing(stream, &status) == cudaSuccess;
  if (!asked) (void)cudaGetLastError();
  return asked && status != cudaStreamCaptureStatusNone;
}

// The side stream captures and warm-ups run on, one per device (Note on CapturedStep::warm_up).
c10::cuda::CUDAStream capture_stream() {
  static std::mutex mu;
  static std::vector<std::optional<c10::cuda::CUDAStream>> streams;
  const auto device = c10::cuda::current_device();
  std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= static_cast<size_t>(device)) streams.resize(device + 1);
  if (!streams[device]) streams[device] = c10::cuda::getStreamFromPool(false, device);
  return *streams[device];
}

// Makes `waiter` wait for the work already on `producer` (an event, no host wait).
void order_after(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess)
    throw std::runtime_error("CUDA graph: cudaEventCreate failed");
  const bool ok = cudaEventRecord(e, producer.stream()) == cudaSuccess &&
                  cudaStreamWaitEvent(waiter.stream(), e, 0) == cudaSuccess;
  cudaEventDestroy(e);
  if (!ok) throw std::runtime_error("CUDA graph: ordering streams failed");
}

// Note [a failed capture]
// A capture fails when the step does something a capture refuses (a host synchronisation, a copy
// from pageable memory, a query of a captured event). LibTorch 2.11's CUDAGraph::capture_end
// throws on the failed cudaStreamEndCapture before it ends the allocator's routing of this
// stream's allocations into the graph's private pool, and its destructor does not release that
// pool; 2.15 does both itself. So whatever the version, after a failure: the stream's capture is
// ended, the routing ended (an error here means LibTorch did it already), the CUDA generators out
// of capture mode (end_capture_mode), the graph destroyed, the pool released if a use of it is
// left, and the cache emptied, so that the allocator and the random numbers are as usable as
// before and the next error names its own cause. Only a GPU run proves this
// (tests/gpu/test_gpu.cpp, "a failed capture ...").
void abandon_capture(std::unique_ptr<Graph> graph, const c10::cuda::CUDAStream& side, c10::MempoolId_t pool) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const auto device = side.device_index();
  if (is_capturing(side.stream())) {
    try {
      graph->capture_end();
    } catch (...) {
    }
  }
  if (is_capturing(side.stream())) {  // capture_end refused before ending it
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(side.stream(), &partial) == cudaSuccess && partial) cudaGraphDestroy(partial);
  }
  try {
    alloc::endAllocateToPool(device, pool);
  } catch (...) {
  }
  graph->end_generators_capture();
  graph.reset();
  try {
    if (alloc::getPoolUseCount(device, pool) > 0) alloc::releasePool(device, pool);
  } catch (...) {
    // No such pool any more: the graph released it.
  }
  (void)cudaGetLastError();  // the capture's errors are not sticky; the caller reports the first
  try {
    alloc::emptyCache();
  } catch (...) {
  }
}

}  // namespace

std::unique_ptr<CapturedStep> CapturedStep::capture(const std::function<void()>& step) {
  auto impl = std::make_unique<Impl>();
  // Capture needs a stream other than the default one; the side stream starts after the work
  // already queued, and the caller's stream continues after the capture's (empty) work.
  const auto caller = c10::cuda::getCurrentCUDAStream();
  const auto side = capture_stream();
  // The eager warm-up steps leave freed blocks cached in the default pool; the graph allocates
  // from a private pool of its own, so return them to the device first.
  c10::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  order_after(side, caller);
  const auto pool = at::cuda::graph_pool_handle();
  {
    c10::cuda::CUDAStreamGuard guard(side);
    try {
      impl->graph->capture_begin(pool);
      step();
      impl->graph->capture_end();
    } catch (const std::exception& e) {
      const std::string what = e.what();
      abandon_capture(std::move(impl->graph), side, pool);
      throw std::runtime_error(
          "CUDA graph capture of the step failed (the allocator is restored; run with "
          "train.cuda_graph=false, or FSDPP_CHECK_DEVICES=1 to find host copies): " +
          what);
    }
  }
  order_after(caller, side);
  return std::unique_ptr<CapturedStep>(new CapturedStep(std::move(impl)));
}

void CapturedStep::warm_up(const std::function<void()>& step) {
  const auto caller = c10::cuda::getCurrentCUDAStream();
  const auto side = capture_stream();
  order_after(side, caller);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    step();
  }
  order_after(caller, side);
}

void CapturedStep::replay() { impl_->graph->replay(); }

int current_cuda_device() { return c10::cuda::current_device(); }

bool stream_capturing(int device) {
  const auto d = device < 0 ? c10::cuda::current_device() : static_cast<c10::DeviceIndex>(device);
  return is_capturing(c10::cuda::getCurrentCUDAStream(d).stream());
}

}  // namespace fsdpp

#else

namespace fsdpp {

struct CapturedStep::Impl {};

std::unique_ptr<CapturedStep> CapturedStep::capture(const std::function<void()>&) {
  throw std::runtime_error(
      "CUDA graph capture needs fsdpp built against a CUDA LibTorch (this build is CPU-only)");
}

void CapturedStep::warm_up(const std::function<void()>& step) { step(); }

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
