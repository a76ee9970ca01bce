#include "fsdpp/fsdp/fully_shard.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <unordered_map>
#include <unordered_set>

namespace fsdpp::fsdp {

namespace detail {

std::string join_path(const std::string& a, const std::string& b) {
  return a.empty() ? b : b.empty() ? a : a + "." + b;
}

namespace {

// The first FullyShard units below `m` (not looking inside them), with their paths.
void find_units(torch::nn::Module& m, const std::string& path,
                std::vector<std::pair<std::string, UnitHolder*>>& out) {
  for (auto& child : m.named_children()) {
    const auto p = join_path(path, child.key());
    if (auto* h = dynamic_cast<UnitHolder*>(child.value().get()))
      out.emplace_back(p, h);
    else
      find_units(*child.value(), p, out);
  }
}

}  // namespace

void shard_tree(UnitHolder& top, const comm::Comm& comm, const FullyShardOptions& options,
                const std::string& path) {
  Unit& unit = top.fsdp_unit();
  if (unit.is_sharded())
    throw std::invalid_argument(fmt::format("fully_shard: '{}' is already sharded", unit.label()));
  if (!path.empty()) unit.set_label(path);
  torch::nn::Module& module = top.fsdp_wrapped();

  std::vector<std::pair<std::string, UnitHolder*>> nested;
  find_units(module, "", nested);
  std::vector<Unit*> nested_units;
  std::unordered_map<const void*, std::string> owned;  // TensorImpl -> nested unit's path
  for (auto& [p, h] : nested) {
    if (!h->fsdp_unit().is_sharded()) shard_tree(*h, comm, options, join_path(path, p));
    for (Unit* u : h->fsdp_unit().tree_units()) {
      u->set_prefix(join_path(p, u->prefix()));
      u->set_label(join_path(path, u->prefix()));
      nested_units.push_back(u);
    }
    for (auto& param : h->fsdp_wrapped().named_parameters()) owned[param.value().unsafeGetTensorImpl()] = p;
  }

  std::vector<ParamSpec> specs;
  std::unordered_map<const void*, size_t> index;
  for (auto& param : module.named_parameters()) {
    const void* key = param.value().unsafeGetTensorImpl();
    if (auto it = owned.find(key); it != owned.end()) {
      const auto& owner = it->second;
      if (param.key().rfind(owner + ".", 0) != 0)
        throw std::invalid_argument(fmt::format(
            "fully_shard: parameter '{}' is tied to a parameter of unit '{}'; tied parameters must "
            "live in one unit (shard their common parent instead)",
            join_path(path, param.key()), join_path(path, owner)));
      continue;
    }
    if (auto it = index.find(key); it != index.end()) {
      specs[it->second].names.push_back(param.key());  // tied within this unit: managed once
      continue;
    }
    index[key] = specs.size();
    specs.push_back({{param.key()}, param.value()});
  }
  // The policy's callables see names from the module fully_shard was called on (specs name them
  // from this unit).
  auto from_top = [&path](auto f) -> decltype(f) {
    if (!f || path.empty()) return f;
    return [f, path](const std::string& name, const at::Tensor& t) { return f(join_path(path, name), t); };
  };
  FullyShardOptions named = options;
  named.mp.param_dtype_override = from_top(options.mp.param_dtype_override);
  named.mp.grad_dtype = from_top(options.mp.grad_dtype);
  unit.shard(comm, std::move(specs), named);
  unit.become_root(nested_units);
}

}  // namespace detail

namespace {

// Four running sums, so that one addition need not wait for the one before.
template <typename T>
double sum_of_squares(const T* x, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) s[k] += static_cast<double>(x[i + k]) * static_cast<double>(x[i + k]);
  for (; i < n; ++i) s[0] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace

at::Tensor squared_sum(const std::vector<at::Tensor>& tensors, at::Device device) {
  at::NoGradGuard no_grad;  // a gradient built with create_graph requires grad itself
  double host = 0;
  auto total = at::zeros({}, at::TensorOptions(device).dtype(at::kDouble));
  for (const auto& g : tensors) {
    const bool in_place = g.device().is_cpu() && g.is_contiguous();
    if (in_place && g.scalar_type() == at::kFloat)
      host += sum_of_squares(g.const_data_ptr<float>(), g.numel());
    else if (in_place && g.scalar_type() == at::kDouble)
      host += sum_of_squares(g.const_data_ptr<double>(), g.numel());
    else
      total.add_(g.to(at::kDouble).pow(2).sum());
  }
  if (host != 0) total.add_(host);
  return total;
}

double clip_grad_norm(UnitHolder& root, double max_norm) {
  std::vector<at::Tensor> grads;
  for (Unit* u : root.fsdp_unit().tree_units())
    for (auto& p : u->group().sharded_parameters())
      if (p.grad().defined()) grads.push_back(p.grad());
  // Padding rows are not part of any shard, so local squares sum to this rank's share exactly.
  auto total = squared_sum(grads, grads.empty() ? at::Device(at::kCPU) : grads.front().device()).view({1});
  root.fsdp_unit().comm().all_reduce(total).wait();
  const double norm = std::sqrt(total.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coef);
  }
  return norm;
}

std::vector<Shard> shards(UnitHolder& root) {
  std::vector<Shard> out;
  for (Unit* u : root.fsdp_unit().tree_units()) {
    auto infos = u->group().shard_infos();
    auto params = u->group().sharded_parameters();
    for (size_t i = 0; i < infos.size(); ++i)
      out.push_back({detail::join_path(u->prefix(), infos[i].names.front()), infos[i], params[i]});
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> full_state_dict(UnitHolder& root) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (Unit* u : root.fsdp_unit().tree_units()) {
    auto full = u->group().gather_full_params();
    auto infos = u->group().shard_infos();
    for (size_t i = 0; i < infos.size(); ++i)
      for (const auto& name : infos[i].names) out.emplace_back(detail::join_path(u->prefix(), name), full[i]);
  }
  return out;
}

void load_full_state_dict(UnitHolder& root, const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::unordered_map<std::string, at::Tensor> by_name(state.begin(), state.end());
  std::vector<std::string> missing;
  size_t used = 0;
  for (Unit* u : root.fsdp_unit().tree_units()) {
    std::vector<at::Tensor> full;
    for (const auto& info : u->group().shard_infos()) {
      const auto name = detail::join_path(u->prefix(), info.names.front());
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        missing.push_back(name);
        continue;
      }
      full.push_back(it->second);
      used += info.names.size();
    }
    if (missing.empty()) u->group().load_full_params(full);
  }
  if (!missing.empty())
    throw std::invalid_argument(
        fmt::format("load_full_state_dict: missing parameter(s) {}", fmt::join(missing, ", ")));
}

}  // namespace fsdpp::fsdp
