// model.init_from by rows: a run builds its model without bytes (Note [unallocated parameters]),
// shards it, and each rank reads from the file only the rows of its shards.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "comm/ranks.hpp"
#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/base/storage.hpp"
#include "fsdpp/fsdp/fully_shard.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/sharding.hpp"

using namespace fsdpp;

namespace {

models::MoEConfig config() {
  models::MoEConfig c;
  c.dim = 32, c.heads = 4, c.kv_heads = 2, c.layers = 3, c.max_seq_len = 32, c.ffn_hidden = 48;
  c.dense_layers = 1, c.experts = 4, c.top_k = 2, c.expert_hidden = 24, c.vocab_size = 96;
  return c;
}

// Reads of rows, (tensor, first, count), by every rank.
struct ReadLog {
  std::mutex mu;
  std::vector<std::tuple<std::string, int64_t, int64_t>> reads;
};

std::vector<train::LazyTensor> logged(std::vector<train::LazyTensor> weights, ReadLog& log) {
  for (auto& w : weights)
    w.rows = [rows = w.rows, name = w.name, &log](int64_t first, int64_t count) {
      std::lock_guard<std::mutex> lock(log.mu);
      log.reads.emplace_back(name, first, count);
      return rows(first, count);
    };
  return weights;
}

}  // namespace

TEST_CASE("init_from by rows: no rank builds the full model, and each reads only the rows of its shards") {
  const auto c = config();
  at::manual_seed(5);
  std::map<std::string, at::Tensor> reference;
  for (auto& p : models::MoETransformer(c)->named_parameters())
    reference[p.key()] = p.value().detach().clone();
  const auto file =
      (std::filesystem::temp_directory_path() / ("fsdpp-loading-" + std::to_string(getpid()))).string();
  write_safetensors(file,
                    std::vector<std::pair<std::string, at::Tensor>>(reference.begin(), reference.end()));

  for (const bool expert_parallel : {false, true}) {
    CAPTURE(expert_parallel);
    ReadLog log;
    const auto weights = logged(train::read_weights_by_rows(file), log);
    std::mutex shards_mu;
    std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> kept;  // name -> (offset, rows) per rank
    test::run_ranks(expert_parallel ? 4 : 2, [&](comm::Comm& world) {
      const int r = world.rank();
      auto model = models::MoETransformer(c, models::Weights::kUnallocated);
      for (const auto& p : model->named_parameters()) {
        CAPTURE(p.key());
        CHECK(is_unallocated(p.value()));
      }
      train::check_full_weights(*model, weights, file);
      std::optional<train::ExpertSharding> experts;
      if (expert_parallel) {
        experts = train::ExpertSharding{.ep = world.split(r / 2, r), .shard = world.split(r % 2, r)};
        train::apply_expert_parallel(*model, experts->ep);
      }
      auto root = train::shard_model(model, world, {}, 0, experts);
      train::load_shards(*root.ptr(), weights, file);
      for (const auto& s : fsdp::shards(*root.ptr())) {
        CAPTURE(s.name);
        CHECK(s.param.equal(reference.at(s.name).narrow(0, s.info.row_offset, s.info.local_rows)));
        std::lock_guard<std::mutex> lock(shards_mu);
        kept[s.name].emplace_back(s.info.row_offset, s.info.local_rows);
      }
    });
    // Every read is one rank's shard, and each shard was read once.
    std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> read;
    for (const auto& [name, first, count] : log.reads) read[name].emplace_back(first, count);
    CHECK(kept.size() == reference.size());
    for (auto& [name, shards] : kept) {
      CAPTURE(name);
      std::sort(shards.begin(), shards.end());
      std::sort(read[name].begin(), read[name].end());
      CHECK(read[name] == shards);
    }
  }

  {  // a tensor missing from the weights, or of another shape, is refused, naming it
    auto weights = train::read_weights_by_rows(file);
    auto model = models::MoETransformer(c, models::Weights::kUnallocated);
    auto wrong = weights;
    wrong.front().shape.front() += 1;
    const auto message = [&](const std::vector<train::LazyTensor>& w) {
      try {
        train::check_full_weights(*model, w, file);
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    CHECK(message(wrong).find("'" + wrong.front().name + "' has shape") != std::string::npos);
    const auto missing = weights.back().name;
    weights.pop_back();
    CHECK(message(weights).find("parameter '" + missing + "' is missing") != std::string::npos);
  }
  std::filesystem::remove(file);
}
