#pragma once
// Activation checkpointing: a module wrapper that keeps only its input in forward and runs the
// wrapped forward again in backward, so the activations inside the module live only while its
// own backward runs.
//
// The wrapper adopts the module's parameters, buffers and children under their own names (the
// model's parameter names do not change), and composes with fully_shard: wrap the block in
// Checkpoint first, then in fsdp::FullyShard. The unit gathers its parameters before its backward
// (pre_backward), which is when the recompute needs them, so a unit's forward runs twice per step
// with no extra all-gather.
//
// The recompute runs a nested backward that accumulates the parameters' gradients and returns
// the input's. So a backward split into an input half (I) and a weight half (W), as zero-bubble
// pipeline schedules do, would count the weight gradients twice: the trainer refuses those
// schedules with checkpointing. The wrapped forward must be deterministic (this model has no
// dropout); random state is not replayed.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

namespace fsdpp::train {

class CheckpointImpl : public torch::nn::Module {
 public:
  // `inner`'s forward takes a tensor and a second one without gradient (a block's hidden states
  // and positions, models::BlockImpl::forward), kept for the recompute; returns one tensor.
  explicit CheckpointImpl(torch::nn::AnyModule inner);
  at::Tensor forward(at::Tensor x, at::Tensor aside);
  // Forwards recomputed in backward since construction.
  int64_t recomputes() const { return recomputes_; }

 private:
  friend struct RecomputeInBackward;
  torch::nn::AnyModule inner_;
  int64_t recomputes_ = 0;
};
TORCH_MODULE(Checkpoint);

// Which of a model's blocks to checkpoint: `every` 0 none, 1 all, k every block whose layer index
// is a multiple of k.
inline bool checkpoints_layer(int64_t every, int64_t layer) { return every > 0 && layer % every == 0; }

}  // namespace fsdpp::train
