#include "fsdpp/fsdp/unit.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <mutex>
#include <typeinfo>
#include <unordered_map>

namespace fsdpp::fsdp {

namespace {

// Parameters owned by some unit, so that sharding one twice fails clearly.
std::mutex g_registry_mu;
std::unordered_map<const void*, std::string> g_registry;  // TensorImpl* -> owning unit's label

// Note [post-backward hook]
// A unit's post-backward must run once the gradient of its inputs is computed: then its whole
// backward is done, and the engine has run its parameters' AccumulateGrad nodes too (it runs those
// as soon as they are ready). Two ways to be told:
//  - The common case, one input needing a gradient that some node produced (a block fed the
//    previous block's output): a hook on that producing node. The engine calls a node's tensor
//    pre-hooks when the gradients into it are complete, just before it runs the node, and the unit
//    is among the consumers it waits for. The node is usually the previous unit's output node,
//    and one hook object there runs this unit's post-backward, then that unit's pre-backward
//    (the reduce-scatter goes out before the next prefetch). This adds nothing to the graph. If
//    the input is also used outside the unit (a residual added by the caller), the node waits for
//    that use's gradient too, so the post-backward can come later than the unit's own backward
//    ends: never too early.
//  - Otherwise (several inputs, a leaf input such as a pipeline stage's received activations, an
//    input whose node already serves another unit's post-backward): an identity node between the
//    inputs and the unit, which runs once all their gradients are in.
//    That is a node per unit per step for the engine to schedule, and the engine's set-up around
//    each node it runs costs more than the hook (bench/results/unit_cost_count.md).
// Either runs post_backward at most once per backward; a unit whose hook or node never ran (its
// inputs needed no gradient, a first layer fed token ids) runs it at the end of backward.

// The identity node behind marked inputs: it passes their gradients through. A plain Node rather
// than a custom autograd Function: it needs neither saved state nor the Function machinery's
// output checks.
struct PostBackwardNode final : torch::autograd::Node {
  explicit PostBackwardNode(Unit* unit) : unit(unit) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    unit->post_backward();
    return std::move(grads);
  }
  std::string name() const override { return "fsdpp::PostBackward"; }
  Unit* unit;
};

// A tensor pre-hook that leaves the gradients as they are and tells units that backward reached
// the node: `post` that the gradient of its input is in (the node produced that input), then `pre`
// that the gradient of its output is (the node produced that output). A block's input node is the
// previous block's output node, so one hook usually serves both. Added straight to the node
// (Tensor::register_hook would add a hook list, two std::functions and a wrapper per tensor).
struct UnitHooks final : torch::autograd::FunctionPreHook {
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (post) post->post_backward();
    if (pre) pre->pre_backward();
    return grads;
  }
  Unit* post = nullptr;
  Unit* pre = nullptr;
};

// `node`'s UnitHooks, added when it has none.
UnitHooks& hooks_of(torch::autograd::Node& node) {
  auto& hooks = node.tensor_pre_hooks();
  for (auto& h : hooks)  // UnitHooks is final: comparing the type is exact, and cheaper than a cast
    if (typeid(*h) == typeid(UnitHooks)) return static_cast<UnitHooks&>(*h);
  hooks.push_back(std::make_unique<UnitHooks>());
  return static_cast<UnitHooks&>(*hooks.back());
}

// Autograd nodes are held by std::shared_ptr in older releases (2.11 among them) and by
// c10::intrusive_ptr in newer ones (2.15); make the kind Edge takes.
using NodeRef = decltype(torch::autograd::Edge::function);
template <class Ref, class T>
Ref make_node(Unit* unit) {
  if constexpr (std::is_same_v<Ref, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<T>(unit);
  else
    return c10::make_intrusive<T>(unit);
}

}  // namespace

void Unit::set_label(std::string label) {
  label_ = std::move(label);
  if (group_) group_->set_label(label_);
}

Unit::~Unit() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  for (const void* k : owned_) g_registry.erase(k);
}

void Unit::shard(comm::Comm comm, std::vector<ParamSpec> params, FullyShardOptions options) {
  if (group_) throw std::invalid_argument(fmt::format("fully_shard: '{}' is already sharded", label_));
  std::vector<const void*> keys;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    for (const auto& p : params) {
      const void* k = p.param.unsafeGetTensorImpl();
      if (auto it = g_registry.find(k); it != g_registry.end())
        throw std::invalid_argument(
            fmt::format("fully_shard({}): parameter '{}' is already managed by unit '{}'; a module can be "
                        "sharded only once, and tied parameters must live in one unit",
                        label_, p.names.front(), it->second));
      keys.push_back(k);
    }
  }
  comm_ = comm;
  options_ = std::move(options);
  int group_size = 0;
  if (options_.reshard_after_forward)
    if (const int* n = std::get_if<int>(&*options_.reshard_after_forward)) {
      if (*n < 1 || comm_.size() % *n != 0)
        throw std::invalid_argument(
            fmt::format("fully_shard({}): reshard_after_forward={} must be a positive divisor of the world "
                        "size {}",
                        label_, *n, comm_.size()));
      if (*n > 1 && *n < comm_.size()) group_size = *n;
    }
  group_ =
      std::make_unique<ParamGroup>(std::move(comm), std::move(params), options_.mp, label_, group_size,
                                   options_.static_buffers, options_.replicate, options_.expert_parallel);
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    for (const void* k : keys) g_registry[k] = label_;
  }
  owned_ = std::move(keys);
  tree_ = std::make_shared<detail::Tree>();
  tree_->root = this;
  tree_->units = {this};
}

void Unit::become_root(const std::vector<Unit*>& nested) {
  TORCH_INTERNAL_ASSERT(group_, "fsdp: become_root before shard");
  tree_->units.clear();
  for (Unit* u : nested) {
    u->tree_ = tree_;
    tree_->units.push_back(u);
  }
  tree_->units.push_back(this);
  tree_->root = this;
}

ParamGroup& Unit::group() {
  if (!group_)
    throw std::logic_error(fmt::format("fsdp: '{}' is used before fully_shard was called on it", label_));
  return *group_;
}

std::vector<Unit*> Unit::tree_units() const { return tree_ ? tree_->units : std::vector<Unit*>{}; }

int Unit::post_forward_group() const {
  if (tree_ && tree_->reshard_after_forward) return *tree_->reshard_after_forward ? 1 : 0;
  const auto& v = options_.reshard_after_forward;
  // Default: reshard, except the root (needed first in backward) and with static buffers, where
  // resharding frees nothing and would only gather every unit again in backward.
  if (!v) return is_root() || options_.static_buffers ? 0 : 1;
  if (const bool* b = std::get_if<bool>(&*v)) return *b ? 1 : 0;
  const int n = std::get<int>(*v);
  // N = 1 keeps everything (as false); N = world size keeps 1/world size (as true).
  return n == 1 ? 0 : n == comm_.size() ? 1 : n;
}

Unit* Unit::neighbour(const std::vector<Unit*>& order, int64_t pos, int step) const {
  if (pos < 0 || pos >= static_cast<int64_t>(order.size()) || order[pos] != this) return nullptr;
  const int64_t idx = pos + step;
  return idx >= 0 && idx < static_cast<int64_t>(order.size()) ? order[idx] : nullptr;
}

void Unit::pre_forward() {
  if (!group_) return;  // not sharded: a plain module
  auto& tree = *tree_;
  if (is_root() && !tree.backward_active) {
    // A new forward: the order recorded last time drives this time's prefetching.
    // (swapped, not moved: both keep their storage, so this allocates nothing step after step)
    // Each unit also knows its place in both orders, so that finding a neighbour is not a search.
    if (!tree.forward_order.empty()) {
      for (Unit* u : tree.last_forward_order) u->last_order_pos_ = -1;
      std::swap(tree.last_forward_order, tree.forward_order);
      for (size_t i = 0; i < tree.last_forward_order.size(); ++i) {
        tree.last_forward_order[i]->last_order_pos_ = static_cast<int64_t>(i);
        tree.last_forward_order[i]->order_pos_ = -1;
      }
    }
    tree.forward_order.clear();
  }
  group_->wait_unshard();
  if (order_pos_ < 0 || order_pos_ >= static_cast<int64_t>(tree.forward_order.size()) ||
      tree.forward_order[order_pos_] != this) {
    order_pos_ = static_cast<int64_t>(tree.forward_order.size());
    tree.forward_order.push_back(this);
  }
  if (!forward_prefetch_.empty()) {
    for (Unit* u : forward_prefetch_) u->group().unshard_async();
  } else if (Unit* next = neighbour(tree.last_forward_order, last_order_pos_, +1);
             next && next != tree.root) {
    next->group_->unshard_async();
  }
  pre_backward_done_ = false;
  post_backward_done_ = false;
}

at::Tensor Unit::prepare_input(const at::Tensor& input) const {
  const auto& mp = options_.mp;
  if (group_ && mp.cast_forward_inputs && mp.param_dtype && input.defined() && input.is_floating_point() &&
      input.scalar_type() != *mp.param_dtype)
    return input.to(*mp.param_dtype);
  return input;
}

std::vector<at::Tensor> Unit::mark_for_post_backward(at::TensorList inputs) {
  if (!group_ || inputs.empty() || !at::GradMode::is_enabled()) return {};
  // Note [post-backward hook]: one input with a producing node needs no marker.
  // Unless an earlier unit's input came from the same node, which then serves that one.
  if (inputs.size() == 1)
    if (const auto& producer = inputs.front().grad_fn())
      if (UnitHooks& h = hooks_of(*producer); !h.post) {
        h.post = this;
        return {};
      }
  return mark_with_node(inputs);
}

std::vector<at::Tensor> Unit::mark_with_node(at::TensorList inputs) {
  NodeRef node = make_node<NodeRef, PostBackwardNode>(this);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  std::vector<at::Tensor> marked;
  marked.reserve(inputs.size());
  for (const auto& t : inputs) {
    // A new tensor over the input's storage, sharing its version counter, whose gradient flows
    // through the node.
    auto out = torch::autograd::make_variable(t, torch::autograd::Edge(node, node->add_input_metadata(t)));
    torch::autograd::impl::set_version_counter(out, torch::autograd::impl::version_counter(t));
    marked.push_back(std::move(out));
  }
  return marked;
}

at::Tensor Unit::finish_output(const at::Tensor& output) {
  if (!group_ || !output.defined()) return output;
  at::Tensor out = output;
  if (options_.mp.output_dtype && out.is_floating_point()) out = out.to(*options_.mp.output_dtype);
  if (out.requires_grad() && at::GradMode::is_enabled()) {
    if (const auto& node = out.grad_fn()) {
      // Another unit's output from the same node (a unit that returns its input unchanged) leaves
      // this one a hook of its own.
      if (UnitHooks& h = hooks_of(*node); !h.pre || h.pre == this) {
        h.pre = this;
      } else {
        auto own = std::make_unique<UnitHooks>();
        own->pre = this;
        node->add_tensor_pre_hook(std::move(own));
      }
    } else  // a leaf (the module returned a parameter or its input): its gradient accumulator's hook
      out.register_hook([this](const at::Tensor&) { pre_backward(); });
  }
  return out;
}

void Unit::post_forward() {
  if (!group_) return;
  const int n = post_forward_group();
  if (n == 1) group_->reshard();
  if (n > 1) group_->reshard_to_group();
}

void Unit::pre_backward() {
  if (!group_ || pre_backward_done_) return;
  pre_backward_done_ = true;
  detail::Tree& tree = *tree_;
  if (!tree.backward_active) {
    tree.backward_active = true;
    torch::autograd::Engine::get_default_engine().queue_callback([tree = tree_] { finish_backward(tree); });
  }
  group_->wait_unshard();
  group_->defer_grad_upcasts(tree.requires_gradient_sync);  // Note [unsharded gradients]
  if (!backward_prefetch_.empty()) {
    for (Unit* u : backward_prefetch_) u->group().unshard_async();
  } else if (Unit* prev = neighbour(tree.forward_order, order_pos_, -1); prev && prev != tree.root) {
    prev->group_->unshard_async();
  }
}

void Unit::post_backward() {
  if (!group_ || post_backward_done_) return;
  post_backward_done_ = true;
  if (!tree_->requires_gradient_sync) {
    group_->restore_grad_dtypes();  // no-sync microbatch: the sum stays in .grad, no communication
  } else {
    group_->reduce_grads_async();
    if (!options_.overlap_reduce_scatter) group_->finish_reduce();
  }
  if (tree_->reshard_after_backward) group_->reshard();
}

void Unit::finish_backward(const std::shared_ptr<detail::Tree>& tree) {
  // Units whose post-backward hook or node never ran (Note [post-backward hook]: a first layer fed
  // token ids) run their post-backward now, in reverse forward order, the same on every rank.
  for (auto it = tree->forward_order.rbegin(); it != tree->forward_order.rend(); ++it) (*it)->post_backward();
  // Parameters may stay unsharded across no-sync microbatches; after a synchronising backward the
  // optimizer is about to change them, so the unsharded copies must go.
  const bool reshard = tree->reshard_after_backward || tree->requires_gradient_sync;
  for (Unit* u : tree->units) u->group_->average_replicas_async();  // Note [replica average]
  for (Unit* u : tree->units) {
    u->group_->finish_reduce();
    // After a no-sync backward the gradients stay in .grad (Note [unsharded gradients]), and one
    // that came late joins the sum as well.
    if (tree->requires_gradient_sync && u->group_->has_stray_grads())
      throw std::logic_error(
          fmt::format("fsdp: a gradient of unit '{}' arrived after its reduce-scatter was issued; every "
                      "parameter of a unit must be used on the path from the unit's inputs to its outputs",
                      u->label_));
    if (reshard) u->group_->reshard();
    u->pre_backward_done_ = false;
    u->post_backward_done_ = false;
  }
  tree->backward_active = false;
}

void Unit::unshard(bool async) {
  if (!tree_) return;
  // In the order the last forward used the units (the root's first, as its forward starts
  // first), so that the gathers land in the order the next forward waits for them. Units it did
  // not reach, or all of them before any forward, follow in sharding order; unshard_async passes
  // over a unit already gathered or in flight.
  for (Unit* u : tree_->forward_order) u->group().unshard_async();
  tree_->root->group().unshard_async();
  for (Unit* u : tree_units()) u->group().unshard_async();
  if (!async)
    for (Unit* u : tree_units()) u->group().wait_unshard();
}

void Unit::reduce_grads_async() {
  for (Unit* u : tree_units()) u->group().reduce_grads_async();
}

void Unit::wait_reduce_grads() {
  for (Unit* u : tree_units()) u->group().average_replicas_async();  // Note [replica average]
  for (Unit* u : tree_units()) u->group().finish_reduce();
}

void Unit::reshard() {
  for (Unit* u : tree_units()) u->group().reshard();
}

void Unit::set_requires_gradient_sync(bool sync) { tree_->requires_gradient_sync = sync; }
void Unit::set_reshard_after_backward(bool reshard) { tree_->reshard_after_backward = reshard; }
void Unit::set_reshard_after_forward(std::optional<bool> reshard) { tree_->reshard_after_forward = reshard; }

}  // namespace fsdpp::fsdp
