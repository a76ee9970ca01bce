#pragma once
// How the trainer shards its model: each block an FSDP unit, the embedding, final norm and head
// in the root unit; with expert parallelism each MoE layer's experts a unit of their own.

#include <optional>

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/activation_checkpoint.hpp"

namespace fsdpp::train {

using ShardedModel = fsdp::FullyShard<models::MoETransformerImpl>;

// Expert parallelism as torchtitan lays it out: the experts of an MoE layer are spread over `ep`
// (apply_expert_parallel) and sharded over `shard`, the data-parallel ranks that hold the same
// experts; everything else is sharded over all data-parallel ranks.
struct ExpertSharding {
  comm::Comm ep, shard;
};

// The model's token exchange over `ep` (models/token_exchange.hpp): all-to-alls on the
// communicator, named in flight records and traces ("moe all_to_all dispatch", ...).
std::shared_ptr<models::TokenExchange> token_exchange(comm::Comm ep);

// Spreads every MoE layer's experts of a full `model` over the ranks of `ep`, each keeping E / ep of
// them and exchanging routed rows with the others; collective. Call before cutting stages or
// wrapping. Throws when ep does not divide the experts.
inline void apply_expert_parallel(models::MoETransformerImpl& model, const comm::Comm& ep) {
  model.set_expert_parallel(token_exchange(ep));
}

// Wraps each block of `model` (the whole model or a pipeline stage) in an fsdp::FullyShard unit and
// shards the model over `comm`; collective. Parameter names stay those of the unwrapped model.
// `checkpoint_every` > 0: blocks whose layer index is a multiple of it are also recomputed in
// backward (activation_checkpoint.hpp), inside their unit. `experts`: the model's MoE layers are
// already spread over experts->ep; their experts become units sharded over experts->shard, one
// all-gather and one reduce-scatter per layer there besides the block's own.
inline ShardedModel shard_model(models::MoETransformer model, const comm::Comm& comm,
                                const fsdp::FullyShardOptions& options = {}, int64_t checkpoint_every = 0,
                                const std::optional<ExpertSharding>& experts = std::nullopt) {
  if (experts) {
    auto expert_options = options;
    expert_options.expert_parallel = experts->ep;
    for (models::Block block : model->blocks()) {  // holders: copies share the modules
      if (!block->moe) continue;
      auto unit = fsdp::wrap(block->moe->experts);
      fsdp::fully_shard(unit, experts->shard, expert_options);
      block->moe->wrap_experts(torch::nn::AnyModule(unit));
    }
  }
  model->wrap_blocks([checkpoint_every](const models::Block& block, int64_t layer) {
    if (checkpoints_layer(checkpoint_every, layer))
      return torch::nn::AnyModule(fsdp::wrap(Checkpoint(torch::nn::AnyModule(block))));
    return torch::nn::AnyModule(fsdp::wrap(block));
  });
  return fsdp::fully_shard(model, comm, options);
}

}  // namespace fsdpp::train
