#pragma once
// One training step captured as a CUDA graph and replayed. The step must be capturable: static
// inputs the caller fills before each replay, no host reads of device values, the same kernels and
// collectives with the same shapes every time (fully_shard with static_buffers, fsdp::AdamW, MoE
// in capacity mode; the trainer's step is, see Note [capturable step] in trainer.cpp). Run it
// eagerly a few times first, through warm_up(), so that gradients, optimizer state and
// communication buffers exist; tensors the step allocates during capture come from the graph's
// private memory pool and keep their addresses on every replay, so an output kept from the capture
// holds each replay's result.
//
// Available in builds against a CUDA LibTorch (FSDPP_WITH_NCCL=1); elsewhere capture() throws.

#include <functional>
#include <memory>

namespace fsdpp {

class CapturedStep {
 public:
  // Records `step` on a side stream, without running it. Throws std::runtime_error when this build
  // has no CUDA or when capture fails (a host synchronisation inside `step`, for example).
  static std::unique_ptr<CapturedStep> capture(const std::function<void()>& step);
  // Runs `step` eagerly on the side stream that capture() records on (one per device, for the
  // process), after the work queued on the current stream and before what follows. The eager
  // steps before a capture belong there, as PyTorch warms up on its capture's side stream: what
  // a stream keeps (cuBLAS's workspace, the caching allocator's free blocks) is then what the
  // capture meets. Without CUDA it runs `step` as it is.
  static void warm_up(const std::function<void()>& step);
  ~CapturedStep();
  // Runs the recorded step on the current stream.
  void replay();

 private:
  struct Impl;
  explicit CapturedStep(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether the current stream of CUDA device `device` (-1: the current device) is being captured
// into a graph: work issued now is recorded, not run, so the host must not wait for it. False in
// builds without CUDA.
bool stream_capturing(int device = -1);

// The current CUDA device of this process (set by the NCCL backend to LOCAL_RANK); throws without
// CUDA.
int current_cuda_device();

}  // namespace fsdpp
