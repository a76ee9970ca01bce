#pragma once
// Unit: the runtime of one sharded module, independent of the module's C++ type. FullyShard<M>
// (fully_shard.hpp) owns one and calls it around the wrapped forward.
//
// One training step, as a unit sees it:
//   pre_forward      wait for this unit's all-gather (maybe prefetched), prefetch the next unit's
//   forward          the inputs' producing node gets a post-backward hook, or, for several inputs or
//                    a leaf, the inputs pass through an identity autograd node (Note [post-backward
//                    hook] in unit.cpp)
//   post_forward     reshard (unless told not to); hook the outputs for pre_backward
//   pre_backward     (first gradient reaching an output) unshard again, prefetch the unit that
//                    ran before this one
//   post_backward    (the hook or node: the gradient of the inputs is in, so the unit's backward
//                    is done) move .grad into the unsharded accumulators and issue one
//                    asynchronous reduce-scatter, which overlaps the backward of earlier units
//   end of backward  (autograd engine callback, queued by the first pre_backward) post_backward for
//                    units that had none, in reverse forward order, then wait for every
//                    reduce-scatter, so the optimizer never sees a partial gradient.
// All of this happens in the same order on every rank, so collectives match.

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <variant>
#include <string>
#include <vector>

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/fsdp/mixed_precision.hpp"
#include "fsdpp/fsdp/param_group.hpp"

namespace fsdpp::fsdp {

struct FullyShardOptions {
  MixedPrecisionPolicy mp;
  // After forward: true frees the unsharded parameters and gathers them again for backward; false
  // keeps them; an integer N (dividing the world size) keeps 1/N of them on each rank, so that
  // backward gathers only within groups of N consecutive ranks (for example one node). Default:
  // true, except for the root unit, whose parameters are needed first in backward anyway, and
  // with static_buffers, which frees nothing on resharding (false).
  std::optional<std::variant<bool, int>> reshard_after_forward;
  // Issue each unit's reduce-scatter as soon as its gradients are ready (otherwise wait for it
  // right away; for measuring the overlap).
  bool overlap_reduce_scatter = true;
  // Keep the communication buffers and the unsharded parameters allocated for the model's
  // lifetime, at fixed addresses, as CUDA graph replay needs; resharding then only marks the
  // parameters as not gathered (reading one is no longer an error) and saves no memory, so
  // reshard_after_forward defaults to false: one all-gather per unit per step instead of two
  // (bench/results/fsdp.md times both).
  bool static_buffers = false;
  // HSDP (hybrid sharding): the communicator over the replicas of this rank's shard group. The
  // parameters are sharded over the `comm` given to fully_shard as usual; gradients are
  // reduce-scattered within it, then averaged across the replicas by an all-reduce of the
  // reduced shard, so that every replica takes the same optimizer step. Unset: plain FSDP.
  std::optional<comm::Comm> replicate;
  // Expert parallelism: the unit's parameters are this rank's block of equal blocks along dim 0
  // (rank r of this communicator holds block r), for example E / ep experts of every [E, ...]
  // expert tensor. Within `comm` they are sharded as usual. A block's gradient gathers every
  // rank's tokens routed to it, so the reduce-scatter divides by comm size x blocks, which makes
  // it the average over all data-parallel ranks. Shard infos (hence checkpoints) and full state
  // dicts speak of the whole tensors.
  std::optional<comm::Comm> expert_parallel;
};

class Unit;

namespace detail {

// Shared by the units under one root.
struct Tree {
  Unit* root = nullptr;
  std::vector<Unit*> units;  // in sharding order (nested first, root last)
  std::vector<Unit*> forward_order, last_forward_order;
  bool backward_active = false;
  bool requires_gradient_sync = true;
  bool reshard_after_backward = true;
  std::optional<bool> reshard_after_forward;  // set_reshard_after_forward: replaces the units' options
};

}  // namespace detail

class Unit {
 public:
  explicit Unit(std::string label) : label_(std::move(label)) {}
  ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  const std::string& label() const { return label_; }
  // Also renames the unit's collectives in flight records and traces.
  void set_label(std::string label);
  bool is_sharded() const { return group_ != nullptr; }
  // Where this unit sits in its tree ("layers.0"; empty for the tree's root): the prefix of its
  // parameters' names in the unwrapped model.
  const std::string& prefix() const { return prefix_; }
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }
  bool is_root() const { return tree_ && tree_->root == this; }

  // Takes ownership of `params` (collective over `comm`).
  void shard(comm::Comm comm, std::vector<ParamSpec> params, FullyShardOptions options);
  // Makes this unit the root of a tree holding `nested` (already sharded) units.
  void become_root(const std::vector<Unit*>& nested);

  // Called by FullyShard<M>::forward.
  void pre_forward();
  at::Tensor prepare_input(const at::Tensor& input) const;
  // Arranges for post_backward once the gradient of `inputs` is computed. Returns the tensors to
  // call the module with instead of `inputs` (aliases behind an identity node), or nothing when
  // the inputs can be used as they are.
  std::vector<at::Tensor> mark_for_post_backward(at::TensorList inputs);
  at::Tensor finish_output(const at::Tensor& output);
  void post_forward();

  void pre_backward();
  void post_backward();

  // User controls. On the root they apply to the whole tree.
  // Gathers the parameters; with `async`, only issues the all-gathers, which the next forward (or
  // unshard()) waits for. They go out in the order of the last forward, the root's first.
  void unshard(bool async = false);
  void reshard();
  // Issues one asynchronous reduce-scatter per unit for the gradients accumulated unsharded while
  // gradient sync was off (set_requires_gradient_sync(false)); wait_reduce_grads() waits for them
  // and leaves the reduced gradients on the sharded parameters. This is how a pipeline stage
  // reduces once per step, after its last microbatch.
  void reduce_grads_async();
  void wait_reduce_grads();
  void set_requires_gradient_sync(bool sync);
  void set_reshard_after_backward(bool reshard);
  // Replaces every unit's reshard_after_forward option in the tree (false: keep each unit gathered
  // from its forward to its backward, and across forwards, until reshard()); nullopt returns each
  // unit to its own option.
  void set_reshard_after_forward(std::optional<bool> reshard);
  void set_forward_prefetch(std::vector<Unit*> units) { forward_prefetch_ = std::move(units); }
  void set_backward_prefetch(std::vector<Unit*> units) { backward_prefetch_ = std::move(units); }

  ParamGroup& group();
  // The units of this unit's tree (just this one before a root adopts it).
  std::vector<Unit*> tree_units() const;
  comm::Comm& comm() { return comm_; }
  const FullyShardOptions& options() const { return options_; }

 private:
  static void finish_backward(const std::shared_ptr<detail::Tree>& tree);
  // mark_for_post_backward's identity node (Note [post-backward hook]).
  std::vector<at::Tensor> mark_with_node(at::TensorList inputs);
  // 0: keep unsharded after forward; 1: reshard fully; N > 1: keep 1/N (see the option).
  int post_forward_group() const;
  // The unit `step` places from this one in `order`, where this one sits at `pos` (null when it
  // does not, or past either end).
  Unit* neighbour(const std::vector<Unit*>& order, int64_t pos, int step) const;

  std::string label_;
  std::string prefix_;
  comm::Comm comm_;
  FullyShardOptions options_;
  std::unique_ptr<ParamGroup> group_;
  std::shared_ptr<detail::Tree> tree_;
  std::vector<Unit*> forward_prefetch_, backward_prefetch_;
  std::vector<const void*> owned_;                // TensorImpls of the parameters this unit manages
  int64_t order_pos_ = -1, last_order_pos_ = -1;  // in the tree's forward_order, last_forward_order
  bool pre_backward_done_ = false;
  bool post_backward_done_ = false;
};

}  // namespace fsdpp::fsdp
