// fsdpp's side of the gradient comparison with PyTorch 2.15 (tests/fsdp/test_torch_grads.py): a
// four-layer model whose parameters take each of 2.15's gradient dtype rules, sharded as two units,
// trained for one step of 3 microbatches (gradient sync on the last only). Records what a user
// sees: every parameter's unsharded .grad after each microbatch, what a hook on the unsharded
// parameter receives, and the sharded .grad after the reduce-scatter, each in its dtype.
// A torchrun-style rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; Gloo).
//
//   fsdpp_test_grad_probe CASE.safetensors OUT_PREFIX
//
// CASE: the initial full weights ("l0.weight", ... in their original dtypes), "inputs" [3, batch,
//   6] and "targets" [3, batch, 3] (rank r takes its contiguous rows); metadata "fsdpp.case"
//   (JSON: reduce_dtype, null or a dtype name).
// OUT_PREFIX<rank>.safetensors: "mb<j>.<name>" (the .grad after microbatch j, absent when
//   undefined), "hook<j>.<name>" (the hook's gradient in microbatch j) and "sharded.<name>" (this
//   rank's rows of the sharded gradient).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/modules/linear.h>

#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/comm/init.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"

using namespace fsdpp;
using nlohmann::json;

namespace {

// l0 (a unit of its own, as 2.15 wants one original dtype per unit): bfloat16 parameters,
// grad_dtype float32 (wider than compute: the deferred upcast); l1: float32 computing in float32,
// grad_dtype bfloat16 (narrower); l2: float32 computing in bfloat16, grad_dtype none; l3: float32
// computing in bfloat16, grad_dtype unset.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() {
    torch::nn::Linear first(6, 8);
    first->to(at::kBFloat16);
    l0 = register_module("l0", fsdp::wrap(first));
    l1 = register_module("l1", torch::nn::Linear(8, 8));
    l2 = register_module("l2", torch::nn::Linear(8, 4));
    l3 = register_module("l3", torch::nn::Linear(4, 3));
  }
  at::Tensor forward(at::Tensor x) {
    auto h = at::tanh(l0->forward(x.to(l0->inner().weight.scalar_type())));
    h = at::tanh(l1(h.to(l1->weight.scalar_type())));
    h = at::tanh(l2(h.to(l2->weight.scalar_type())));
    return l3(h.to(l3->weight.scalar_type())).to(at::kFloat);
  }
  fsdp::FullyShard<torch::nn::LinearImpl> l0{nullptr};
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(Probe);

std::optional<at::ScalarType> dtype_named(const json& j) {
  if (j.is_null()) return std::nullopt;
  const auto s = j.get<std::string>();
  if (s == "float32") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  throw std::runtime_error("fsdpp.case: reduce_dtype '" + s + "' is not float32 or bfloat16");
}

int run(const std::string& case_path, const std::string& out_prefix) {
  at::set_num_threads(1);
  auto comm = comm::init_from_env();
  const int rank = comm.rank(), world = comm.size();
  auto file = read_safetensors(case_path);
  const auto c = json::parse(file.metadata.at("fsdpp.case"));
  std::map<std::string, at::Tensor> tensors(file.tensors.begin(), file.tensors.end());

  Probe model;
  {
    at::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) p.value().copy_(tensors.at(p.key()));
  }
  fsdp::FullyShardOptions options;
  options.mp.param_dtype = at::kBFloat16;
  options.mp.reduce_dtype = dtype_named(c.at("reduce_dtype"));
  options.mp.param_dtype_override = fsdp::dtype_for({"l1.*"}, at::kFloat);
  options.mp.grad_dtype = [](const std::string& name, const at::Tensor&) -> std::optional<fsdp::GradDtype> {
    if (name.rfind("l0.", 0) == 0) return at::kFloat;
    if (name.rfind("l1.", 0) == 0) return at::kBFloat16;
    if (name.rfind("l2.", 0) == 0) return fsdp::GradDtype::none();
    return std::nullopt;
  };
  auto root = fsdp::fully_shard(model, comm, options);

  std::vector<std::pair<std::string, at::Tensor>> out;
  int microbatch = 0;
  for (auto& p : model->named_parameters())
    p.value().register_hook([&out, &microbatch, name = p.key()](const at::Tensor& g) {
      out.emplace_back(fmt::format("hook{}.{}", microbatch, name), g.detach().clone());
    });
  const auto inputs = tensors.at("inputs"), targets = tensors.at("targets");
  const int64_t micro = inputs.size(0), local = inputs.size(1) / world;
  for (int64_t j = 0; j < micro; ++j) {
    microbatch = int(j);
    root->set_requires_gradient_sync(j + 1 == micro);
    const auto x = inputs[j].narrow(0, rank * local, local), y = targets[j].narrow(0, rank * local, local);
    const auto loss = (root->forward(x) - y).pow(2).mean() / double(micro);
    loss.backward();
    for (auto& p : model->named_parameters())
      if (p.value().grad().defined())
        out.emplace_back(fmt::format("mb{}.{}", j, p.key()), p.value().grad().clone());
  }
  for (auto& s : fsdp::shards(*root.ptr()))
    if (s.param.grad().defined()) out.emplace_back("sharded." + s.name, s.param.grad().clone());
  write_safetensors(fmt::format("{}{}.safetensors", out_prefix, rank), out);
  comm.barrier().wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: fsdpp_test_grad_probe CASE.safetensors OUT_PREFIX\n";
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "fsdpp_test_grad_probe: " << e.what() << "\n";
    return 1;
  }
}
