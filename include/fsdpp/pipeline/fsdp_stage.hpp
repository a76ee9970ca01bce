#pragma once
// A fully_shard root as a pipeline stage's sharding: the one place where the pipeline meets fsdp.
//
//   PipelineStage stage{.index = s, .forward = ..., .parameters = root->parameters(),
//                       .sharding = pipeline::fsdp_sharding(*root)};

#include <memory>

#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/pipeline/stage.hpp"

namespace fsdpp::pipeline {

class FsdpStageSharding final : public StageSharding {
 public:
  explicit FsdpStageSharding(fsdp::UnitHolder& root) : unit_(root.fsdp_unit()) {}
  void begin_step(bool keep_unsharded) override {
    unit_.set_requires_gradient_sync(false);
    unit_.set_reshard_after_backward(false);
    unit_.set_reshard_after_forward(!keep_unsharded);
  }
  void unshard_async() override { unit_.unshard(/*async=*/true); }
  void reshard() override { unit_.reshard(); }
  void reduce_grads_async() override { unit_.reduce_grads_async(); }
  void wait_reduce_grads() override { unit_.wait_reduce_grads(); }

 private:
  fsdp::Unit& unit_;
};

// `root` (a FullyShard module sharded over the data-parallel group) must outlive the stage.
inline std::shared_ptr<StageSharding> fsdp_sharding(fsdp::UnitHolder& root) {
  return std::make_shared<FsdpStageSharding>(root);
}

}  // namespace fsdpp::pipeline
