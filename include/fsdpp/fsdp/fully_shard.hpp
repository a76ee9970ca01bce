#pragma once
// fully_shard: FSDP2-style sharding for LibTorch modules.
//
//   FullyShard<M>     a module that wraps one M (an Impl type such as BlockImpl, or its holder
//                     such as Block) and runs the unit's pre- and post-forward work around
//                     M::forward. It adopts M's parameters, buffers and children under their own
//                     names, so named_parameters() and state dicts read as for the unwrapped model.
//   fully_shard(...)  shards a FullyShard unit, or wraps and shards a root module. Sharding a root
//                     also shards every nested FullyShard unit that is not sharded yet (with the
//                     same options); the root manages the parameters no nested unit owns.
//
// Two ways to use it:
//   (a) Blocks in a torch::nn::ModuleList or Sequential: build the container from FullyShard
//       wrappers (wrap_each() converts an existing one), then shard the root:
//         model->layers = model->replace_module("layers", fsdp::wrap_each<BlockImpl>(model->layers));
//         auto sharded = fsdp::fully_shard(model, comm, options);
//   (b) Your own model class: declare the blocks as members of type fsdp::FullyShard<Block>,
//       constructed from a Block, and call them as before; then shard the root as above.
// Units are called through their forward(); M::forward must not be overloaded or a template.

#include <c10/util/SmallVector.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <concepts>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdpp/base/adopt.hpp"
#include "fsdpp/comm/comm.hpp"
#include "fsdpp/fsdp/unit.hpp"

namespace fsdpp::fsdp {

// What fully_shard looks for when it walks a module tree.
class UnitHolder {
 public:
  virtual ~UnitHolder() = default;
  virtual Unit& fsdp_unit() = 0;
  virtual torch::nn::Module& fsdp_wrapped() = 0;
};

namespace detail {

// A holder (Block) names its module type (BlockImpl); a module type names itself.
template <class M>
struct ImplOf {
  using type = M;
};
template <class M>
requires requires { typename M::ContainedType; }
struct ImplOf<M> {
  using type = typename M::ContainedType;
};

// Gives FullyShardImpl<M> a non-template forward with exactly M::forward's signature, so that
// torch::nn::Sequential (AnyModule) can hold it.
template <class Derived, class Sig>
struct ForwardAs;
template <class Derived, class C, class R, class... A>
struct ForwardAs<Derived, R (C::*)(A...)> {
  R forward(A... args) { return static_cast<Derived*>(this)->run_forward(std::forward<A>(args)...); }
};
template <class Derived, class C, class R, class... A>
struct ForwardAs<Derived, R (C::*)(A...) const> : ForwardAs<Derived, R (C::*)(A...)> {};

// A forward that is neither a template nor overloaded: its address can be taken.
template <class Impl>
concept HasPlainForward = requires {
  &Impl::forward;
};

// A module whose forward is a template or overloaded (torch::nn::Sequential) gets a template
// forward instead.
template <class Derived, class Impl, bool = HasPlainForward<Impl>>
struct ForwardFor : ForwardAs<Derived, decltype(&Impl::forward)> {};
template <class Derived, class Impl>
struct ForwardFor<Derived, Impl, false> {
  template <class... A>
  decltype(auto) forward(A&&... args) {
    return static_cast<Derived*>(this)->run_forward(std::forward<A>(args)...);
  }
};

// The tensors among forward's arguments that need a gradient, for the post-backward hook (held
// inline: a forward takes a few tensors, and this runs for every unit in every step).
using Tensors = c10::SmallVector<at::Tensor, 4>;
inline void collect_tensors(Tensors& out, const at::Tensor& t) {
  if (t.defined() && t.requires_grad()) out.push_back(t);
}
template <class T>
concept NotTensor = !std::is_same_v<std::decay_t<T>, at::Tensor>;

template <NotTensor T>
void collect_tensors(Tensors&, const T&) {}

inline at::Tensor substitute(const Unit& unit, const at::Tensor& t, at::TensorList from, at::TensorList to) {
  for (size_t i = 0; i < to.size(); ++i)
    if (from[i].is_same(t)) return unit.prepare_input(to[i]);
  return unit.prepare_input(t);
}
template <NotTensor T>
T&& substitute(const Unit&, T&& x, at::TensorList, at::TensorList) {
  return std::forward<T>(x);
}

inline at::Tensor finish(Unit& unit, at::Tensor out) { return unit.finish_output(out); }
inline std::vector<at::Tensor> finish(Unit& unit, std::vector<at::Tensor> outs) {
  for (auto& t : outs) t = unit.finish_output(t);
  return outs;
}
template <class... T>
std::tuple<T...> finish(Unit& unit, std::tuple<T...> outs) {
  std::apply([&](auto&... x) { ((x = finish(unit, std::move(x))), ...); }, outs);
  return outs;
}
template <class T>
T finish(Unit&, T out) {
  return out;
}

std::string join_path(const std::string& a, const std::string& b);

// Shards `top` and, first, every nested unit under it that is not sharded yet; `path` is top's
// position in the model, for labels.
void shard_tree(UnitHolder& top, const comm::Comm& comm, const FullyShardOptions& options,
                const std::string& path);

}  // namespace detail

template <class M>
class FullyShardImpl : public torch::nn::Module,
                       public UnitHolder,
                       public detail::ForwardFor<FullyShardImpl<M>, typename detail::ImplOf<M>::type> {
 public:
  using Impl = typename detail::ImplOf<M>::type;
  static_assert(std::is_base_of_v<torch::nn::Module, Impl>,
                "FullyShard<M>: M must be a torch::nn::Module Impl type or a holder of one");

  explicit FullyShardImpl(std::shared_ptr<Impl> inner)
      : unit_(inner ? inner->name() : "null"), inner_(std::move(inner)) {
    TORCH_CHECK(inner_, "FullyShard: cannot wrap a null module");
    adopt_members(*this, *inner_);
  }
  template <class H>
  requires std::is_base_of_v<torch::nn::ModuleHolder<Impl>, H>
  explicit FullyShardImpl(const H& holder) : FullyShardImpl(holder.ptr()) {}

  template <class... A>
  decltype(auto) run_forward(A&&... args) {
    unit_.pre_forward();
    detail::Tensors inputs;
    (detail::collect_tensors(inputs, args), ...);
    const auto marked = unit_.mark_for_post_backward(inputs);
    auto out = inner_->forward(detail::substitute(unit_, std::forward<A>(args), inputs, marked)...);
    unit_.post_forward();
    return detail::finish(unit_, std::move(out));
  }

  void train(bool on = true) override {
    torch::nn::Module::train(on);
    inner_->train(on);
  }

  Impl& inner() { return *inner_; }
  const std::shared_ptr<Impl>& inner_ptr() const { return inner_; }
  Unit& fsdp_unit() override { return unit_; }
  torch::nn::Module& fsdp_wrapped() override { return *this; }

  // Controls, FSDP2's names. On the root they apply to every unit of the model.
  void set_requires_gradient_sync(bool sync) { unit_.set_requires_gradient_sync(sync); }
  void set_reshard_after_backward(bool reshard) { unit_.set_reshard_after_backward(reshard); }
  void set_reshard_after_forward(std::optional<bool> reshard) { unit_.set_reshard_after_forward(reshard); }
  void unshard(bool async = false) { unit_.unshard(async); }
  void reshard() { unit_.reshard(); }
  // Explicit prefetch, replacing the default of one unit ahead: right after this unit's all-gather
  // in forward (backward), issue the all-gathers of `units`.
  void set_modules_to_forward_prefetch(const std::vector<UnitHolder*>& units) {
    unit_.set_forward_prefetch(units_of(units));
  }
  void set_modules_to_backward_prefetch(const std::vector<UnitHolder*>& units) {
    unit_.set_backward_prefetch(units_of(units));
  }

  // The parameters the optimizer updates: this rank's shards, for every unit of the tree.
  std::vector<at::Tensor> sharded_parameters() {
    std::vector<at::Tensor> out;
    for (Unit* u : unit_.tree_units())
      for (auto& t : u->group().sharded_parameters()) out.push_back(t);
    return out;
  }

 private:
  static std::vector<Unit*> units_of(const std::vector<UnitHolder*>& holders) {
    std::vector<Unit*> out;
    for (auto* h : holders) out.push_back(&h->fsdp_unit());
    return out;
  }

  Unit unit_;
  std::shared_ptr<Impl> inner_;
};

template <class M>
class FullyShard : public torch::nn::ModuleHolder<FullyShardImpl<M>> {
 public:
  using torch::nn::ModuleHolder<FullyShardImpl<M>>::ModuleHolder;
  using Impl = FullyShardImpl<M>;
};

// Shards one unit; collective over `comm`. Throws when it is already sharded. A parameter without
// bytes (Note [unallocated parameters] in base/storage.hpp, PyTorch's meta-device
// initialization) is not read: its shard starts as zeros, to be loaded (load_full_state_dict, or
// by rows through shards()).
template <class M>
FullyShard<M>& fully_shard(FullyShard<M>& unit, const comm::Comm& comm,
                           const FullyShardOptions& options = {}) {
  detail::shard_tree(*unit.ptr(), comm, options, "");
  return unit;
}

// Wraps `module` and shards it as the root (see the top of this file).
template <class Impl>
requires std::is_base_of_v<torch::nn::Module, Impl> FullyShard<Impl> fully_shard(
    std::shared_ptr<Impl> module, const comm::Comm& comm, const FullyShardOptions& options = {}) {
  FullyShard<Impl> root(std::make_shared<FullyShardImpl<Impl>>(std::move(module)));
  root->fsdp_unit().set_label("root");
  detail::shard_tree(*root.ptr(), comm, options, "");
  return root;
}
template <class Impl>
FullyShard<Impl> fully_shard(const torch::nn::ModuleHolder<Impl>& module, const comm::Comm& comm,
                             const FullyShardOptions& options = {}) {
  return fully_shard(module.ptr(), comm, options);
}

// This rank's shard of every parameter of the tree, with its name in the unwrapped model.
struct Shard {
  std::string name;
  ShardInfo info;
  at::Tensor param;  // the sharded parameter the optimizer updates (its .grad after backward)
};
std::vector<Shard> shards(UnitHolder& root);

// Every parameter in full, under its name in the unwrapped model, in its original dtype. Collective.
std::vector<std::pair<std::string, at::Tensor>> full_state_dict(UnitHolder& root);
// Sets every parameter's shard from full tensors (for example a full_state_dict() taken at another
// world size). Not collective. Throws naming missing parameters or shape mismatches.
void load_full_state_dict(UnitHolder& root, const std::vector<std::pair<std::string, at::Tensor>>& state);

// The gradient norm over every sharded parameter of the tree (one all-reduce); when it exceeds
// max_norm, the gradients are scaled down to it. Returns the norm before clipping.
double clip_grad_norm(UnitHolder& root, double max_norm);

// The sum of the squares of every element of `tensors`, accumulated in float64, as a 0-dim float64
// tensor on `device` (where the tensors are). Contiguous CPU float32 and float64 tensors are read
// once, in place; others go through g.to(kDouble).pow(2).sum(), which writes two float64
// temporaries of their size first.
at::Tensor squared_sum(const std::vector<at::Tensor>& tensors, at::Device device);

// A FullyShard unit around `module`, not sharded yet: fully_shard on a root above it shards it.
template <class Impl>
FullyShard<Impl> wrap(const torch::nn::ModuleHolder<Impl>& module) {
  return FullyShard<Impl>(std::make_shared<FullyShardImpl<Impl>>(module.ptr()));
}

// Rebuilds a ModuleList of Impl modules as a ModuleList of FullyShard<Impl> units (same child
// names). Throws naming the first element that is not an Impl.
template <class Impl>
torch::nn::ModuleList wrap_each(const torch::nn::ModuleList& list) {
  torch::nn::ModuleList out;
  for (size_t i = 0; i < list->size(); ++i) {
    auto m = std::dynamic_pointer_cast<Impl>(list->ptr(i));
    TORCH_CHECK(m, "wrap_each: element ", i, " is a ", list->ptr(i)->name(), ", not the requested type");
    out->push_back(FullyShard<Impl>(std::make_shared<FullyShardImpl<Impl>>(m)));
  }
  return out;
}

}  // namespace fsdpp::fsdp
