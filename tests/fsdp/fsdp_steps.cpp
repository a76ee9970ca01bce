// fsdpp's side of the comparison with PyTorch's FSDP2 (tests/fsdp/test_torch_fsdp.py): trains the
// MoE model wrapped with fully_shard for a few AdamW steps from given weights on given batches.
// A torchrun-style rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; Gloo).
//
//   fsdpp_test_fsdp_steps CASE.safetensors OUT.safetensors
//
// CASE: the initial full weights under the model's parameter names; "batches", int64
//   [steps, microbatches, global batch, seq + 1] (rank r trains on its contiguous slice of each
//   microbatch); metadata "fsdpp.model_config" (the model) and "fsdpp.case" (JSON: param_dtype,
//   reduce_dtype, float32_params (globs kept in float32 compute), grad_dtype_params ([glob, dtype]
//   pairs: each matching parameter's grad_dtype, the first match winning), lr, weight_decay,
//   betas, eps).
// OUT (rank 0): the final full weights, and "losses" float64 [steps]: each step's training loss
//   (mean next-token cross entropy over the global batch, averaged over microbatches).
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/sharding.hpp"

using namespace fsdpp;
using nlohmann::json;

namespace {

std::optional<at::ScalarType> dtype_named(const json& j, const std::string& key) {
  if (!j.contains(key) || j[key].is_null()) return std::nullopt;
  const auto s = j[key].get<std::string>();
  if (s == "float32") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  throw std::runtime_error(fmt::format("fsdpp.case: {} is '{}', not float32 or bfloat16", key, s));
}

int run(const std::string& case_path, const std::string& out_path) {
  at::set_num_threads(1);
  auto comm = comm::init_from_env();
  const int rank = comm.rank(), world = comm.size();
  auto file = read_safetensors(case_path);
  const auto meta = [&](const std::string& key) {
    const auto it = file.metadata.find(key);
    if (it == file.metadata.end()) throw std::runtime_error(case_path + ": no metadata " + key);
    return json::parse(it->second);
  };
  const auto config = train::parse_model_config(meta("fsdpp.model_config"), case_path);
  const auto c = meta("fsdpp.case");
  at::Tensor batches;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (auto& [name, t] : file.tensors) {
    if (name == "batches")
      batches = t;
    else
      weights.emplace_back(name, t);
  }
  if (!batches.defined() || batches.dim() != 4)
    throw std::runtime_error(case_path + ": needs \"batches\" [steps, microbatches, batch, seq + 1]");
  const int64_t steps = batches.size(0), micro = batches.size(1), global = batches.size(2);
  if (global % world)
    throw std::runtime_error(fmt::format("batch {} does not divide over {} ranks", global, world));

  auto model = models::MoETransformer(config);
  train::load_full_weights(*model, weights, case_path);

  fsdp::FullyShardOptions options;
  options.mp.param_dtype = dtype_named(c, "param_dtype");
  options.mp.reduce_dtype = dtype_named(c, "reduce_dtype");
  if (auto keep = c.value("float32_params", std::vector<std::string>{}); !keep.empty())
    options.mp.param_dtype_override = fsdp::dtype_for(keep, at::kFloat);
  if (const auto rules = c.value("grad_dtype_params", json::array()); !rules.empty())
    options.mp.grad_dtype = [rules](const std::string& name,
                                    const at::Tensor&) -> std::optional<at::ScalarType> {
      for (const auto& r : rules)
        if (fsdp::glob_match(r[0].get<std::string>(), name)) return dtype_named(json{{"d", r[1]}}, "d");
      return std::nullopt;
    };
  auto root = train::shard_model(model, comm, options);

  // Weight decay on matrices only, as the trainer does.
  std::vector<at::Tensor> decay, no_decay;
  for (auto& s : fsdp::shards(*root.ptr()))
    (s.info.global_shape.size() >= 2 ? decay : no_decay).push_back(s.param);
  fsdp::AdamWOptions opt;
  opt.lr = c.at("lr").get<double>();
  opt.weight_decay = c.at("weight_decay").get<double>();
  opt.beta1 = c.at("betas")[0].get<double>();
  opt.beta2 = c.at("betas")[1].get<double>();
  opt.eps = c.at("eps").get<double>();
  fsdp::AdamW optimizer(std::move(decay), opt, std::move(no_decay));

  const int64_t local = global / world;
  auto losses = at::zeros({steps}, at::kDouble);
  root->inner().router_stats().aux_grad_scale = 1.0 / double(micro);
  for (int64_t s = 0; s < steps; ++s) {
    optimizer.zero_grad();
    double sum = 0;
    for (int64_t j = 0; j < micro; ++j) {
      root->set_requires_gradient_sync(j + 1 == micro);
      const auto rows = batches[s][j].narrow(0, rank * local, local);
      const auto x = rows.narrow(1, 0, rows.size(1) - 1), y = rows.narrow(1, 1, rows.size(1) - 1);
      const auto loss = models::lm_loss(root->forward(x), y);
      (loss / double(micro)).backward();
      sum += loss.item<double>();
    }
    optimizer.step();
    auto mean = at::full({1}, sum / double(micro * world), at::kDouble);
    comm.all_reduce(mean).wait();
    losses[s] = mean[0];
    if (rank == 0)
      std::cout << fmt::format("step {} loss {:.6f}", s + 1, losses[s].item<double>()) << std::endl;
  }
  auto full = fsdp::full_state_dict(*root.ptr());
  if (rank == 0) {
    full.emplace_back("losses", losses);
    write_safetensors(out_path, full);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: fsdpp_test_fsdp_steps CASE.safetensors OUT.safetensors\n";
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "fsdpp_test_fsdp_steps: " << e.what() << std::endl;
    return 1;
  }
}
