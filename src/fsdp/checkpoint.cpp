#include "fsdpp/fsdp/checkpoint.hpp"

#include "fsdpp/fsdp/adamw.hpp"

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/safetensors.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace fsdpp::fsdp {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "fsdpp-sharded-2";

struct Saved {
  std::string file;
  json index;
  SafetensorsFile data;
  const at::Tensor& tensor(const std::string& name) const {
    const at::Tensor* t = data.find(name);
    if (!t) throw std::runtime_error(fmt::format("checkpoint: tensor '{}' is missing from {}", name, file));
    return *t;
  }
};

// Integers of an index: a float, a string or a value beyond int64 is damage, not a number to
// convert.
bool is_int64(const json& v) {
  return v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX));
}

int64_t integer(const json& object, const char* key, const std::string& file) {
  const json& v = object.at(key);
  if (!is_int64(v))
    throw std::runtime_error(
        fmt::format("checkpoint: '{}' in {} is not a 64-bit integer: {}", key, file, v.dump()));
  return v.get<int64_t>();
}

std::vector<int64_t> shape_of(const json& entry, const std::string& file) {
  const json& v = entry.at("shape");
  if (!v.is_array()) throw std::runtime_error(fmt::format("checkpoint: 'shape' in {} is not an array", file));
  std::vector<int64_t> shape;
  for (const auto& d : v) {
    if (!is_int64(d) || d.get<int64_t>() < 0)
      throw std::runtime_error(fmt::format("checkpoint: 'shape' in {} holds {}, not a size", file, d.dump()));
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

json read_json(const fs::path& path) {
  try {
    return read_json_file(path.string());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("checkpoint: ") + e.what());
  }
}

// Every rank's index and tensors, checked for the fields loading relies on.
// Which ranks' files to read: all of them (a checkpoint on shared storage, or the directories of
// every node), or only those present (one node's directory of a checkpoint on local storage).
enum class Ranks { kAll, kPresent };

std::vector<Saved> read_all_checked(const std::vector<std::string>& dirs, Ranks which);
std::vector<Saved> read_all(const std::vector<std::string>& dirs, Ranks which = Ranks::kAll) {
  try {
    return read_all_checked(dirs, which);
  } catch (const json::exception& e) {
    // A field of the wrong type or missing: the index is damaged.
    throw std::runtime_error(
        fmt::format("checkpoint: an index in {} is malformed: {}", fmt::join(dirs, ", "), e.what()));
  }
}

// The data file against the size and CRC-32C its index records (indexes written before checksums
// have none).
void check_digest(const json& index, const std::string& file, const std::string& index_file) {
  if (!index.contains("data")) return;
  const json& d = index.at("data");
  const int64_t bytes = integer(d, "bytes", index_file);
  if (bytes < 0) throw std::runtime_error(fmt::format("checkpoint: 'bytes' in {} is negative", index_file));
  check_file_digest(file, static_cast<uint64_t>(bytes), d.at("crc32c").get<std::string>(), index_file);
}

// One rank's index and tensors, checked for the fields loading relies on.
Saved read_rank(const std::string& dir, int64_t r) {
  Saved sv;
  const auto index_file = (fs::path(dir) / fmt::format("rank{}.json", r)).string();
  sv.index = read_json(index_file);
  sv.file = (fs::path(dir) / fmt::format("rank{}.safetensors", r)).string();
  check_digest(sv.index, sv.file, index_file);
  sv.data = read_safetensors(sv.file);
  for (const auto& e : sv.index.at("entries")) {
    const auto& t = sv.tensor(e.at("name").get<std::string>());
    const auto shape = shape_of(e, index_file);
    const int64_t rows = integer(e, "rows", index_file), offset = integer(e, "row_offset", index_file);
    if (e.contains("step")) integer(e, "step", index_file);
    bool ok = !shape.empty() && offset >= 0 && rows >= 0 && offset <= shape[0] - rows &&
              t.dim() == int64_t(shape.size()) && t.size(0) == rows;
    for (size_t d = 1; ok && d < shape.size(); ++d) ok = t.size(int64_t(d)) == shape[d];
    if (!ok)
      throw std::runtime_error(fmt::format("checkpoint: entry '{}' of {} does not match its tensor",
                                           e.at("name").get<std::string>(), sv.file));
  }
  return sv;
}

// The world size the checkpoint in `dirs` was saved at, from the first index found (every index
// names it), with the directory of each rank's files ("" where none holds them).
std::vector<std::string> rank_dirs(const std::vector<std::string>& dirs) {
  std::optional<json> first;
  std::string first_file;
  for (const auto& dir : dirs) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const auto name = e.path().filename().string();
      if (name.rfind("rank", 0) == 0 && name.size() > 9 && name.compare(name.size() - 5, 5, ".json") == 0 &&
          (!first || name < fs::path(first_file).filename().string())) {
        first = read_json(e.path());
        first_file = e.path().string();
      }
    }
  }
  if (!first) throw std::runtime_error(fmt::format("checkpoint: {}/rank0.json is missing", dirs.front()));
  if (first->value("format", "") != kFormat)
    throw std::runtime_error(fmt::format("checkpoint: {} is not a {} index", first_file, kFormat));
  const int64_t world = integer(*first, "world_size", first_file);
  if (world < 1 || world > 1 << 16)
    throw std::runtime_error(fmt::format("checkpoint: {} has world_size {}", first_file, world));
  std::vector<std::string> where(world);
  for (int64_t r = 0; r < world; ++r)
    for (const auto& dir : dirs)
      if (where[r].empty() && fs::exists(fs::path(dir) / fmt::format("rank{}.json", r))) where[r] = dir;
  return where;
}

// Calls `each` with every rank's files in turn (only those present, with Ranks::kPresent).
void for_each_rank(const std::vector<std::string>& dirs, Ranks which,
                   const std::function<void(Saved&&)>& each) {
  const auto where = rank_dirs(dirs);
  for (int64_t r = 0; r < static_cast<int64_t>(where.size()); ++r) {
    if (where[r].empty() && which == Ranks::kPresent) continue;
    each(read_rank(where[r].empty() ? dirs.front() : where[r], r));  // a missing index: named as missing
  }
}

std::vector<Saved> read_all_checked(const std::vector<std::string>& dirs, Ranks which) {
  std::vector<Saved> saved;
  for_each_rank(dirs, which, [&](Saved&& sv) { saved.push_back(std::move(sv)); });
  return saved;
}

}  // namespace

void write_shard_files(const std::vector<Shard>& shards, int rank, int world, const std::string& dir,
                       AdamW* optimizer) {
  fs::create_directories(dir);
  json entries = json::array();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const int64_t steps = optimizer ? optimizer->steps() : 0;
  for (const auto& s : shards) {
    json e = {{"name", s.name},
              {"shape", s.info.global_shape},
              {"row_offset", s.info.row_offset},
              {"rows", s.info.local_rows},
              {"dtype", c10::toString(s.param.scalar_type())}};
    tensors.emplace_back(s.name, s.param.detach().cpu());  // .cpu(): no copy for CPU tensors
    if (optimizer)
      if (auto* st = optimizer->state(s.param)) {
        e["step"] = steps;
        tensors.emplace_back(s.name + ".exp_avg", st->exp_avg.cpu());
        tensors.emplace_back(s.name + ".exp_avg_sq", st->exp_avg_sq.cpu());
      }
    entries.push_back(std::move(e));
  }
  json index = {{"format", kFormat}, {"world_size", world}, {"rank", rank}, {"entries", entries}};
  const auto base = fs::path(dir) / fmt::format("rank{}", rank);
  // The tensors first, the index last: an index always describes a complete file.
  write_safetensors(base.string() + ".safetensors", tensors, {{"format", kFormat}});  // synced, then renamed
  // Its size and checksum go into the index: loading then finds damage to any byte.
  const auto digest = digest_file(base.string() + ".safetensors");
  index["data"] = {{"file", base.filename().string() + ".safetensors"},
                   {"bytes", digest.bytes},
                   {"crc32c", crc_hex(digest.crc32c)}};
  write_file_atomically(base.string() + ".json", index.dump(1));
}

void save_sharded(UnitHolder& root, const std::string& dir, AdamW* optimizer) {
  auto& comm = root.fsdp_unit().comm();
  auto replicate = root.fsdp_unit().options().replicate;  // HSDP: the first replica group writes
  if (!replicate || replicate->rank() == 0)
    write_shard_files(shards(root), comm.rank(), comm.size(), dir, optimizer);
  comm.barrier().wait();  // the checkpoint is complete when every rank's files are in place
  if (replicate) replicate->barrier().wait();
}

void read_shard_files(const std::vector<Shard>& shards, const std::string& dir, AdamW* optimizer,
                      bool present_only) {
  const auto saved = read_all({dir}, present_only ? Ranks::kPresent : Ranks::kAll);
  at::NoGradGuard no_grad;
  std::optional<int64_t> steps_loaded;
  for (const auto& s : shards) {
    const int64_t lo = s.info.row_offset, hi = lo + s.info.local_rows;
    int64_t covered = 0;
    std::optional<int64_t> step;
    AdamW::State* state = optimizer ? optimizer->state(s.param) : nullptr;
    if (optimizer && !state)
      throw std::invalid_argument(fmt::format("checkpoint: the optimizer does not update '{}'", s.name));
    bool found = false;
    for (const auto& sv : saved)
      for (const auto& e : sv.index.at("entries")) {
        if (e.at("name") != s.name) continue;
        found = true;
        if (e.at("shape").get<std::vector<int64_t>>() != s.info.global_shape)
          throw std::runtime_error(fmt::format("checkpoint: '{}' has shape {} in {} but [{}] in the model",
                                               s.name, e.at("shape").dump(), dir,
                                               fmt::join(s.info.global_shape, ", ")));
        const int64_t elo = e.at("row_offset"), ehi = elo + e.at("rows").get<int64_t>();
        if (state && e.contains("step")) step = e.at("step").get<int64_t>();
        const int64_t a = std::max(lo, elo), b = std::min(hi, ehi);
        if (a >= b) continue;
        auto take = [&](const std::string& key) { return sv.tensor(key).narrow(0, a - elo, b - a); };
        s.param.narrow(0, a - lo, b - a).copy_(take(s.name));
        covered += b - a;
        if (state && e.contains("step")) {
          state->exp_avg.narrow(0, a - lo, b - a).copy_(take(s.name + ".exp_avg"));
          state->exp_avg_sq.narrow(0, a - lo, b - a).copy_(take(s.name + ".exp_avg_sq"));
        }
      }
    if (!found) throw std::runtime_error(fmt::format("checkpoint: '{}' is not in {}", s.name, dir));
    if (covered != s.info.local_rows)
      throw std::runtime_error(
          fmt::format("checkpoint: rows {}..{} of '{}' are not all in {}{}", lo, hi, s.name, dir,
                      present_only ? " (on local storage a node holds its own ranks' rows: resume "
                                     "at the layout the checkpoint was saved at)"
                                   : ""));
    if (state) {
      // A checkpoint saved without optimizer state starts the optimizer afresh.
      if (!step) {
        state->exp_avg.zero_();
        state->exp_avg_sq.zero_();
      }
      if (steps_loaded && *steps_loaded != step.value_or(0))
        throw std::runtime_error(
            fmt::format("checkpoint: '{}' has optimizer step {} in {} but another parameter has {}", s.name,
                        step.value_or(0), dir, *steps_loaded));
      steps_loaded = step.value_or(0);
    }
  }
  if (optimizer && steps_loaded) optimizer->set_steps(*steps_loaded);
}

void load_sharded(UnitHolder& root, const std::string& dir, AdamW* optimizer) {
  root.fsdp_unit().reshard();
  read_shard_files(shards(root), dir, optimizer);
}

void verify_sharded(const std::string& dir, bool present_only) {
  try {
    for_each_rank({dir}, present_only ? Ranks::kPresent : Ranks::kAll, [](Saved&&) {});
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint: an index in {} is malformed: {}", dir, e.what()));
  }
}

std::vector<std::pair<std::string, at::Tensor>> read_full_parameters(const std::vector<std::string>& dirs) {
  const auto saved = read_all(dirs);
  const auto dir = fmt::format("{}", fmt::join(dirs, " + "));
  // Everything the indexes claim is checked against the rows the ranks hold before any full tensor
  // is allocated: a damaged index must not make the reader allocate its claimed shape.
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, int64_t> covered;
  for (const auto& sv : saved)
    for (const auto& e : sv.index.at("entries")) {
      const auto name = e.at("name").get<std::string>();
      const auto& rows = sv.tensor(name);
      const auto shape = e.at("shape").get<std::vector<int64_t>>();
      const auto offset = e.at("row_offset").get<int64_t>();
      const auto trailing = rows.dim() > 0 ? rows.sizes().slice(1).vec() : std::vector<int64_t>{};
      if (shape.empty() || std::vector<int64_t>(shape.begin() + 1, shape.end()) != trailing || offset < 0 ||
          offset > shape[0] - rows.size(0))
        throw std::runtime_error(
            fmt::format("checkpoint: '{}' in {}: shape {} with rows {}..{} does not fit the {} rows "
                        "held, of shape {}",
                        name, dir, fmt::join(shape, "x"), offset, offset + rows.size(0), rows.size(0),
                        fmt::join(rows.sizes(), "x")));
      if (auto [it, fresh] = shapes.emplace(name, shape); !fresh && it->second != shape)
        throw std::runtime_error(
            fmt::format("checkpoint: '{}' differs in shape between ranks in {}", name, dir));
      covered[name] += rows.size(0);
    }
  for (const auto& [name, shape] : shapes)
    if (covered[name] != shape[0])
      throw std::runtime_error(
          fmt::format("checkpoint: {} of {} rows of '{}' are in {}", covered[name], shape[0], name, dir));

  std::vector<std::pair<std::string, at::Tensor>> out;
  std::map<std::string, size_t> where;
  for (const auto& sv : saved)
    for (const auto& e : sv.index.at("entries")) {
      const auto name = e.at("name").get<std::string>();
      const auto& rows = sv.tensor(name);
      auto it = where.find(name);
      if (it == where.end()) {
        it = where.emplace(name, out.size()).first;
        out.emplace_back(name, at::empty(shapes[name], rows.options()));
      }
      auto& full = out[it->second].second;
      if (full.scalar_type() != rows.scalar_type())
        throw std::runtime_error(
            fmt::format("checkpoint: '{}' differs in dtype between ranks in {}", name, dir));
      full.narrow(0, e.at("row_offset").get<int64_t>(), rows.size(0)).copy_(rows);
    }
  return out;
}

}  // namespace fsdpp::fsdp
