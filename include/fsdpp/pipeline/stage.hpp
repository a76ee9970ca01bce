#pragma once
// What the pipeline executor (pipeline/executor.hpp) runs: a stage, and, when the stage's
// parameters are sharded over data-parallel ranks, the few operations the plan's UNSHARD, RESHARD
// and REDUCE_GRAD actions need. The pipeline knows sharding only through StageSharding;
// pipeline/fsdp_stage.hpp implements it for fully_shard units.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace fsdpp::pipeline {

class StageSharding {
 public:
  virtual ~StageSharding() = default;
  // Before each step: gradients accumulate unsharded over the microbatches with no communication,
  // the parameters stay gathered after each backward, and after each forward too when
  // `keep_unsharded` (otherwise nested units gather again for each microbatch).
  virtual void begin_step(bool keep_unsharded) = 0;
  virtual void unshard_async() = 0;       // UNSHARD: issue the all-gathers; the stage's forward waits
  virtual void reshard() = 0;             // RESHARD: free the gathered parameters
  virtual void reduce_grads_async() = 0;  // REDUCE_GRAD: issue the reduce-scatters
  virtual void wait_reduce_grads() = 0;   // the reduced gradients are on the sharded parameters
};

struct PipelineStage {
  int index = 0;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<at::Tensor> parameters;  // for the weight-gradient half (W) of a split backward
  // Set when the stage's parameters are sharded over the data-parallel group: the plan's UNSHARD /
  // RESHARD / REDUCE_GRAD actions then drive it, and its gradients are reduced once per step,
  // after the stage's last backward.
  std::shared_ptr<StageSharding> sharding;
};

}  // namespace fsdpp::pipeline
