#pragma once
// How the trainer shards its model: each block an FSDP unit, the embedding, final norm and head
// in the root unit.

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/activation_checkpoint.hpp"

namespace fsdpp::train {

using ShardedModel = fsdp::FullyShard<models::MoETransformerImpl>;

// Wraps each block of `model` (the whole model or a pipeline stage) in an fsdp::FullyShard unit and
// shards the model over `comm`; collective. Parameter names stay those of the unwrapped model.
// `checkpoint_every` > 0: blocks whose layer index is a multiple of it are also recomputed in
// backward (activation_checkpoint.hpp), inside their unit.
inline ShardedModel shard_model(models::MoETransformer model, const comm::Comm& comm,
                                const fsdp::FullyShardOptions& options = {}, int64_t checkpoint_every = 0) {
  model->wrap_blocks([checkpoint_every](const models::Block& block, int64_t layer) {
    if (checkpoints_layer(checkpoint_every, layer))
      return torch::nn::AnyModule(fsdp::wrap(Checkpoint(torch::nn::AnyModule(block))));
    return torch::nn::AnyModule(fsdp::wrap(block));
  });
  return fsdp::fully_shard(model, comm, options);
}

}  // namespace fsdpp::train
