#include "fsdpp/train/model_files.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <set>
#include <unordered_map>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/fsdp/checkpoint.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/train/checkpoints.hpp"
#include "fsdpp/train/hf.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using nlohmann::json;

FullWeights read_full_weights(const std::string& path) {
  FullWeights w;
  // Files that predate the tokenizer record were all trained on bytes.
  const json bytes = Tokenizer::load("bytes")->identity();
  if (hf::is_checkpoint_dir(path)) {
    auto imported = hf::import_checkpoint(path);
    w.tokenizer = imported.tokenizer;
    w.config = imported.config;
    w.state = std::move(imported.state);
  } else if (fs::is_regular_file(path)) {
    auto file = read_safetensors(path, /*mapped=*/true);
    const auto t = file.metadata.find("fsdpp.tokenizer");
    w.tokenizer = t == file.metadata.end() ? bytes : json::parse(t->second);
    const auto it = file.metadata.find("fsdpp.model_config");
    if (it == file.metadata.end())
      throw std::runtime_error(fmt::format(
          "{}: no fsdpp.model_config in its metadata (not written by fsdpp ckpt consolidate)", path));
    w.config = parse_model_config(json::parse(it->second), path + " metadata");
    w.state = std::move(file.tensors);
  } else {
    const auto dir = find_checkpoint(path);
    verify_checkpoint(dir);  // every reader checks the checksums first (docs/checkpoints.md)
    const json meta = read_json_file((fs::path(dir) / "trainer.json").string());
    w.config = parse_model_config(meta.at("model"), dir + "/trainer.json");
    w.tokenizer = meta.value("tokenizer", bytes);
    w.state = fsdp::read_full_parameters(dir);
  }
  return w;
}

models::MoETransformer load_model(const std::string& path, json* tokenizer) {
  auto w = read_full_weights(path);
  if (tokenizer) *tokenizer = w.tokenizer;
  auto model = models::MoETransformer(w.config);
  load_full_weights(*model, w.state, path);
  return model;
}

namespace {

// Throws naming `source` when a tensor of the weights is not a parameter of `params`, has another
// shape or is not floating point; returns the parameter.
const at::Tensor& matching_parameter(const torch::OrderedDict<std::string, at::Tensor>& params,
                                     const std::string& name, at::IntArrayRef shape, at::ScalarType dtype,
                                     const std::string& source) {
  const auto* p = params.find(name);
  if (!p)
    throw std::runtime_error(fmt::format("{}: tensor '{}' is not a parameter of the model", source, name));
  if (p->sizes() != shape)
    throw std::runtime_error(fmt::format("{}: '{}' has shape [{}] but the model expects [{}]", source, name,
                                         fmt::join(shape, ", "), fmt::join(p->sizes(), ", ")));
  if (!at::isFloatingType(dtype))
    throw std::runtime_error(
        fmt::format("{}: '{}' is {}, not a floating-point tensor", source, name, c10::toString(dtype)));
  return *p;
}

void check_none_missing(const torch::OrderedDict<std::string, at::Tensor>& params,
                        const std::set<std::string>& seen, const std::string& source) {
  for (const auto& p : params)
    if (!seen.count(p.key()))
      throw std::runtime_error(fmt::format("{}: parameter '{}' is missing", source, p.key()));
}

// Weights that hold NaN or infinity train to NaN at once, and the run would blame the learning
// rate: refused where they are read, naming the tensor.
void check_finite(const at::Tensor& t, const std::string& name, const std::string& source) {
  if (at::is_floating_point(t) && !at::isfinite(t).all().item<bool>())
    throw std::runtime_error(
        fmt::format("{}: tensor {} holds {} values (NaN or infinite): the weights are "
                    "damaged or were saved from a diverged run",
                    source, name, (~at::isfinite(t)).sum().item<int64_t>()));
}

}  // namespace

void load_full_weights(models::MoETransformerImpl& model,
                       const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const std::string& source) {
  at::NoGradGuard g;
  const auto params = model.named_parameters();
  std::set<std::string> seen;
  for (const auto& [name, t] : state) {
    auto p = matching_parameter(params, name, t.sizes(), t.scalar_type(), source);
    check_finite(t, name, source);
    p.copy_(t);  // in the model's dtype
    seen.insert(name);
  }
  check_none_missing(params, seen, source);
}

void check_full_weights(const models::MoETransformerImpl& model, const std::vector<LazyTensor>& weights,
                        const std::string& source) {
  const auto params = model.named_parameters();
  std::set<std::string> seen;
  for (const auto& w : weights) {
    matching_parameter(params, w.name, w.shape, w.dtype, source);
    seen.insert(w.name);
  }
  check_none_missing(params, seen, source);
}

std::vector<LazyTensor> read_weights_by_rows(const std::string& path) {
  if (hf::is_checkpoint_dir(path)) return hf::import_checkpoint_lazy(path).tensors;
  std::vector<LazyTensor> out;
  for (const auto& [name, t] : read_safetensors(path, /*mapped=*/true).tensors)
    out.push_back(lazy_view(name, t));
  return out;
}

void load_shards(fsdp::UnitHolder& root, const std::vector<LazyTensor>& weights, const std::string& source) {
  std::unordered_map<std::string, const LazyTensor*> by_name;
  for (const auto& w : weights) by_name[w.name] = &w;
  at::NoGradGuard g;
  for (auto& s : fsdp::shards(root)) {
    const auto it = by_name.find(s.name);
    if (it == by_name.end())
      throw std::runtime_error(fmt::format("{}: parameter '{}' is missing", source, s.name));
    const auto rows = it->second->rows(s.info.row_offset, s.info.local_rows);
    check_finite(rows, s.name, source);
    s.param.copy_(rows);
  }
}

}  // namespace fsdpp::train
