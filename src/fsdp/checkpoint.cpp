#include "fsdp/checkpoint.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

namespace fsdpp::fsdp {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The optimizer keys its state by the parameter's TensorImpl; LibTorch 1.13 spells the key as a
// string, later versions may use the pointer itself.
template <class Map>
typename Map::key_type state_key(const Map&, const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return Key(p.unsafeGetTensorImpl());
  }
}

torch::optim::AdamWParamState* adam_state(torch::optim::AdamW& opt, const at::Tensor& p) {
  auto& state = opt.state();
  auto it = state.find(state_key(state, p));
  return it == state.end() ? nullptr : static_cast<torch::optim::AdamWParamState*>(it->second.get());
}

struct Saved {
  json index;
  std::vector<at::Tensor> tensors;
};

}  // namespace

void save_sharded(UnitHolder& root, const std::string& dir, torch::optim::AdamW* optimizer) {
  auto& comm = root.fsdp_unit().comm();
  fs::create_directories(dir);
  json entries = json::array();
  std::vector<at::Tensor> tensors;
  for (const auto& s : shards(root)) {
    json e = {{"name", s.name},
              {"shape", s.info.global_shape},
              {"row_offset", s.info.row_offset},
              {"rows", s.info.local_rows},
              {"dtype", c10::toString(s.param.scalar_type())},
              {"param", tensors.size()}};
    tensors.push_back(s.param.detach());
    if (optimizer)
      if (auto* st = adam_state(*optimizer, s.param)) {
        e["step"] = st->step();
        e["exp_avg"] = tensors.size();
        tensors.push_back(st->exp_avg());
        e["exp_avg_sq"] = tensors.size();
        tensors.push_back(st->exp_avg_sq());
      }
    entries.push_back(std::move(e));
  }
  const json index = {{"format", "fsdpp-sharded-1"},
                      {"world_size", comm.size()},
                      {"rank", comm.rank()},
                      {"entries", entries}};
  const auto base = fs::path(dir) / fmt::format("rank{}", comm.rank());
  torch::save(tensors, base.string() + ".pt.tmp");
  {
    std::ofstream f(base.string() + ".json.tmp");
    f << index.dump(1);
    if (!f) throw std::runtime_error("save_sharded: cannot write " + base.string() + ".json.tmp");
  }
  fs::rename(base.string() + ".pt.tmp", base.string() + ".pt");
  fs::rename(base.string() + ".json.tmp", base.string() + ".json");
  comm.barrier().wait();  // the checkpoint is complete when every rank's files are in place
}

void load_sharded(UnitHolder& root, const std::string& dir, torch::optim::AdamW* optimizer) {
  auto read_index = [&](int r) {
    const auto path = fs::path(dir) / fmt::format("rank{}.json", r);
    std::ifstream f(path);
    if (!f) throw std::runtime_error(fmt::format("load_sharded: {} is missing", path.string()));
    try {
      return json::parse(f);
    } catch (const json::exception& e) {
      throw std::runtime_error(fmt::format("load_sharded: {} is not valid JSON: {}", path.string(), e.what()));
    }
  };
  const json first = read_index(0);
  const int saved_world = first.at("world_size").get<int>();
  std::vector<Saved> saved(saved_world);
  for (int r = 0; r < saved_world; ++r) {
    saved[r].index = r == 0 ? first : read_index(r);
    torch::load(saved[r].tensors, (fs::path(dir) / fmt::format("rank{}.pt", r)).string());
  }
  at::NoGradGuard no_grad;
  root.fsdp_unit().reshard();
  for (const auto& s : shards(root)) {
    const int64_t lo = s.info.row_offset, hi = lo + s.info.local_rows;
    int64_t covered = 0;
    std::optional<int64_t> step;
    at::Tensor exp_avg, exp_avg_sq;
    if (optimizer) {
      exp_avg = at::zeros_like(s.param);
      exp_avg_sq = at::zeros_like(s.param);
    }
    bool found = false;
    for (const auto& sv : saved)
      for (const auto& e : sv.index.at("entries")) {
        if (e.at("name") != s.name) continue;
        found = true;
        if (e.at("shape").get<std::vector<int64_t>>() != s.info.global_shape)
          throw std::runtime_error(fmt::format("load_sharded: '{}' has shape {} in {} but [{}] in the model",
                                               s.name, e.at("shape").dump(), dir,
                                               fmt::join(s.info.global_shape, ", ")));
        const int64_t elo = e.at("row_offset"), ehi = elo + e.at("rows").get<int64_t>();
        const int64_t a = std::max(lo, elo), b = std::min(hi, ehi);
        if (a >= b) continue;
        auto take = [&](const char* key) {
          return sv.tensors.at(e.at(key).get<size_t>()).narrow(0, a - elo, b - a);
        };
        s.param.narrow(0, a - lo, b - a).copy_(take("param"));
        covered += b - a;
        if (optimizer && e.contains("step")) {
          step = e.at("step").get<int64_t>();
          exp_avg.narrow(0, a - lo, b - a).copy_(take("exp_avg"));
          exp_avg_sq.narrow(0, a - lo, b - a).copy_(take("exp_avg_sq"));
        }
      }
    if (!found) throw std::runtime_error(fmt::format("load_sharded: '{}' is not in {}", s.name, dir));
    if (covered != s.info.local_rows)
      throw std::runtime_error(fmt::format("load_sharded: rows {}..{} of '{}' are not all in {}",
                                           lo, hi, s.name, dir));
    if (optimizer && step) {
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      st->step(*step);
      st->exp_avg(exp_avg);
      st->exp_avg_sq(exp_avg_sq);
      auto& state = optimizer->state();
      state[state_key(state, s.param)] = std::move(st);
    }
  }
}

}  // namespace fsdpp::fsdp
