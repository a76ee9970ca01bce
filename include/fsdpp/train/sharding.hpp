#pragma once
// How the trainer shards its model: each block an FSDP unit, the embedding, final norm and head
// in the root unit.

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/models/moe.hpp"

namespace fsdpp::train {

using ShardedModel = fsdp::FullyShard<models::MoETransformerImpl>;

// Wraps each block of `model` (the whole model or a pipeline stage) in an fsdp::FullyShard unit and
// shards the model over `comm`; collective. Parameter names stay those of the unwrapped model.
inline ShardedModel shard_model(models::MoETransformer model, const comm::Comm& comm,
                                const fsdp::FullyShardOptions& options = {}) {
  model->wrap_blocks([](const models::Block& block) { return torch::nn::AnyModule(fsdp::wrap(block)); });
  return fsdp::fully_shard(model, comm, options);
}

}  // namespace fsdpp::train
