#include "fsdpp/train/checkpoints.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"
#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/fsdp/checkpoint.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The CRC-32C of a JSON record without its own "crc32c" field, as written (dump(1)).
std::string record_checksum(json record) {
  record.erase("crc32c");
  const auto text = record.dump(1);
  return crc_hex(crc32c(text.data(), text.size()));
}

}  // namespace

std::string step_dir_name(int64_t step) { return fmt::format("step-{:08}", step); }

std::optional<std::string> latest_checkpoint(const std::string& output_dir) {
  const fs::path dir = fs::path(output_dir) / "checkpoints";
  // A pointer that is not a regular file (a FIFO would block the read) names nothing.
  std::error_code ec;
  if (!fs::is_regular_file(dir / "latest", ec)) return std::nullopt;
  std::ifstream f(dir / "latest");
  std::string name;
  // A committed directory however damaged (verify_checkpoint says how): a resume skips it with a
  // message, and nothing mistakes the run for one without checkpoints.
  if (f && std::getline(f, name) && name.rfind("step-", 0) == 0 && fs::is_directory(dir / name))
    return (dir / name).string();
  return std::nullopt;
}

std::vector<std::string> committed_checkpoints(const std::string& output_dir) {
  const fs::path dir = fs::path(output_dir) / "checkpoints";
  std::vector<std::string> out;
  const auto latest = latest_checkpoint(output_dir);
  if (latest) out.push_back(*latest);
  std::vector<std::string> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step-", 0) == 0 && (!latest || e.path().string() != *latest))
      steps.push_back(e.path().string());
  }
  std::sort(steps.rbegin(), steps.rend());  // step-<N> names sort by step
  out.insert(out.end(), steps.begin(), steps.end());
  return out;
}

std::pair<int, uint64_t> verify_checkpoint(const std::string& dir, bool present_only) {
  const auto meta_file = (fs::path(dir) / "trainer.json").string();
  json meta = json::object();
  // A directory fsdp::save_sharded wrote has no trainer.json: its ranks' files are still checked.
  // One the trainer committed (checkpoints/step-<N>) always has one.
  const bool committed_by_trainer =
      fs::path(dir).lexically_normal().filename().string().rfind("step-", 0) == 0 &&
      fs::path(dir).lexically_normal().parent_path().filename() == "checkpoints";
  if (fs::exists(meta_file) || committed_by_trainer || !fs::exists(fs::path(dir) / "rank0.json")) {
    try {
      meta = read_json_file(meta_file);
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(std::string("checkpoint: ") + e.what());
    }
  }
  try {
    if (meta.contains("crc32c") && meta.at("crc32c").get<std::string>() != record_checksum(meta))
      throw std::runtime_error(fmt::format(
          "checkpoint: {} is damaged: its contents do not match the CRC-32C it records", meta_file));
    const json files = meta.value("files", json::object());
    for (const auto& [name, d] : files.items()) {
      const auto file = (fs::path(dir) / name).string();
      // On local storage a node holds its own ranks' files; trainer.json names every rank's node.
      if (!fs::exists(file) && (present_only || d.contains("node"))) continue;
      check_file_digest(file, d.at("bytes").get<uint64_t>(), d.at("crc32c").get<std::string>(), meta_file);
    }
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint: {} is malformed: {}", meta_file, e.what()));
  }
  fsdp::verify_sharded(dir, present_only || meta.value("storage", "shared") == "local");
  int files = 0;
  uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) ++files, bytes += e.file_size();
  return {files, bytes};
}

// A checkpoint directory, given it or an output directory.
std::string find_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "trainer.json")) return path;
  if (auto latest = latest_checkpoint(path)) return *latest;
  throw BadInput(
      fmt::format("{} is neither a checkpoint (no trainer.json) nor a run directory with one", path));
}

json resume_settings(const Recipe& r) {
  const auto& d = r.data;
  const auto& o = r.optim;
  return {{"train.seed", r.train.seed},
          {"train.global_batch", r.train.global_batch},
          {"train.steps", r.train.steps},
          {"data.source", name_of(d.source)},
          {"data.paths", d.paths},
          {"data.path", d.path},
          {"data.tokenizer", d.tokenizer},
          {"data.seq_len", d.seq_len},
          {"data.val_fraction", d.val_fraction},
          {"data.synthetic_bytes", d.synthetic_bytes},
          {"optim.lr", o.lr},
          {"optim.min_lr_ratio", o.min_lr_ratio},
          {"optim.weight_decay", o.weight_decay},
          {"optim.beta1", o.beta1},
          {"optim.beta2", o.beta2},
          {"optim.eps", o.eps},
          {"optim.warmup_steps", o.warmup_steps},
          {"optim.grad_clip", o.grad_clip}};
}

std::vector<std::string> resume_changes(const json& recorded, const json& now) {
  std::vector<std::string> changes;
  for (const auto& [key, value] : now.items()) {
    const auto it = recorded.find(key);
    if (it == recorded.end() || *it != value)
      changes.push_back(fmt::format("{}: {} -> {}", key, it == recorded.end() ? "(not recorded)" : it->dump(),
                                    value.dump()));
  }
  return changes;
}

void write_commit_record(const std::string& dir, json meta) {
  meta["crc32c"] = record_checksum(meta);
  write_file_atomically((fs::path(dir) / "trainer.json").string(), meta.dump(1) + "\n");
}

void commit_checkpoint(const std::string& checkpoints_dir, int64_t step, int64_t keep) {
  const fs::path dir = checkpoints_dir;
  const fs::path tmp = dir / (".tmp-" + step_dir_name(step)), final_dir = dir / step_dir_name(step);
  // The rename is atomic, and `latest` moves only after it.
  const fs::path old = dir / (".old-" + step_dir_name(step));
  fs::remove_all(old);
  if (fs::exists(final_dir)) fs::rename(final_dir, old);
  fs::rename(tmp, final_dir);
  fs::remove_all(old);
  sync_to_disk(dir.string());
  write_file_atomically((dir / "latest").string(), step_dir_name(step) + "\n");
  std::vector<fs::path> done;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0) done.push_back(e.path());
  std::sort(done.begin(), done.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < done.size(); ++i) fs::remove_all(done[i]);
}

std::string consolidate_checkpoint(const std::vector<std::string>& paths, const std::string& output_file,
                                   bool overwrite) {
  std::vector<std::string> dirs;
  json meta;
  for (const auto& path : paths) dirs.push_back(find_checkpoint(path));
  // What the output must not replace: the files read, the run's pointer and its other checkpoints
  // (a file written beside them, such as the default model.safetensors, is fine).
  std::vector<std::string> protected_paths;
  for (const auto& dir : dirs) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const auto name = e.path().filename().string();
      if (name == "trainer.json" || name.rfind("rank", 0) == 0) protected_paths.push_back(e.path().string());
    }
    const auto checkpoints = fs::path(dir).parent_path();
    protected_paths.push_back((checkpoints / "latest").string());
    for (const auto& e : fs::directory_iterator(checkpoints, ec))
      if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0 &&
          !fs::equivalent(e.path(), dir, ec))
        protected_paths.push_back(e.path().string());
  }
  check_output_file(output_file, protected_paths, overwrite);
  // Every reader checks the checksums first (docs/checkpoints.md); one node's directory of a
  // checkpoint on local storage holds only its ranks' files.
  for (const auto& dir : dirs) verify_checkpoint(dir, /*present_only=*/dirs.size() > 1);
  for (const auto& dir : dirs) {
    const json m = read_json_file((fs::path(dir) / "trainer.json").string());
    if (meta.is_null())
      meta = m;
    else if (m.at("step") != meta.at("step"))
      throw std::runtime_error(
          fmt::format("{} holds step {} but {} step {}: give the directories of one checkpoint", dir,
                      m.at("step").dump(), dirs.front(), meta.at("step").dump()));
  }
  const auto full = fsdp::read_full_parameters(dirs);
  write_safetensors(
      output_file, full,  // through a temporary file: nothing under the name unless whole
      {{"format", "pt"},
       {"fsdpp.model_config", meta.at("model").dump()},
       {"fsdpp.tokenizer", meta.value("tokenizer", Tokenizer::load("bytes")->identity()).dump()},
       {"fsdpp.step", std::to_string(meta.at("step").get<int64_t>())}});
  return fmt::format("{}", fmt::join(dirs, " + "));
}

}  // namespace fsdpp::train
