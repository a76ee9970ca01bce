// The trainer's checkpoints: written by every rank and committed once complete; restored from
// the newest one that verifies (include/fsdpp/train/checkpoints.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <limits>

#include "fsdpp/train/checkpoints.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "trainer_impl.hpp"

namespace fsdpp::train::detail {

std::vector<std::string> check_resume_settings(const std::string& dir, const json& meta, const Recipe& recipe,
                                               const RunOptions& options) {
  // Checkpoints from before resume_settings were recorded are not compared.
  if (!meta.contains("resume_settings")) return {};
  const auto changes = resume_changes(meta["resume_settings"], resume_settings(recipe));
  if (!changes.empty() && !options.resume_with_changes)
    throw std::runtime_error(
        fmt::format("--resume: {} was written with other settings, which its data order or optimizer state "
                    "depend on:\n  {}\n"
                    "resume with the recipe it was written with, or pass --resume-with-changes to continue "
                    "with these changes",
                    dir, fmt::join(changes, "\n  ")));
  return changes;
}

void Trainer::save_checkpoint(int64_t step) {
  const auto t0 = Clock::now();
  const fs::path dir = out_ / "checkpoints";
  const fs::path tmp = dir / (".tmp-" + step_dir_name(step)), final_dir = dir / step_dir_name(step);
  if (checkpoint_writer()) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  try {
    write_checkpoint(step, tmp);
  } catch (...) {
    // A checkpoint that failed (a full disk, a lost peer) leaves nothing behind: only committed
    // directories count, and a half-written one would only take space.
    std::error_code ec;
    if (checkpoint_writer()) fs::remove_all(tmp, ec);
    throw;
  }
  log(fmt::format("checkpoint: {} ({:.1f} s)", final_dir.string(),
                  std::chrono::duration<double>(Clock::now() - t0).count()));
  world().barrier().wait();
}

// The files of checkpoint `step` into `tmp`, then the commit (save_checkpoint).
void Trainer::write_checkpoint(int64_t step, const fs::path& tmp) {
  const fs::path dir = tmp.parent_path();
  world().barrier().wait();
  // One copy: with HSDP the first replica group's ranks write (files numbered over them), the
  // other groups hold the same shards.
  const int files_world = recipe_.parallel.pp * recipe_.parallel.dp_shard();
  const int file_rank = mesh_.coord("pp") * recipe_.parallel.dp_shard() + mesh_.coord("dp_shard");
  if (first_replica())
    fsdp::write_shard_files(all_shards(), file_rank, files_world, tmp.string(),
                            optimizer_.get());  // written and synced
  maybe_fire("kill_in_checkpoint", rank_, step);
  // Every file's index (which records its tensor file's checksum), by size and CRC-32C, goes into
  // the commit record, which records its own: every byte of a checkpoint is covered.
  std::vector<double> digests(3 * static_cast<size_t>(files_world), 0.0);
  if (first_replica()) {
    const auto index = digest_file((tmp / fmt::format("rank{}.json", file_rank)).string());
    digests[3 * file_rank] = static_cast<double>(index.bytes);
    digests[3 * file_rank + 1] = static_cast<double>(index.crc32c);
    digests[3 * file_rank + 2] = node_;
  }
  digests = sum_over_world(digests);
  if (checkpoint_writer()) {
    json files = json::object();
    for (int r = 0; r < files_world; ++r) {
      json f = {{"bytes", static_cast<int64_t>(digests[3 * r])},
                {"crc32c", crc_hex(static_cast<uint32_t>(digests[3 * r + 1]))}};
      if (local_storage()) f["node"] = static_cast<int>(digests[3 * r + 2]);
      files[fmt::format("rank{}.json", r)] = f;
    }
    json meta = {
        {"format", kRunCheckpointFormat},
        {"step", step},
        {"world_size", world().size()},
        {"dp", recipe_.parallel.dp},
        {"pp", recipe_.parallel.pp},
        {"dp_replicate", recipe_.parallel.dp_replicate},
        {"ep", recipe_.parallel.ep},
        {"model", to_json(recipe_.model)},
        {"recipe", recipe_.resolved},
        {"resume_settings", resume_settings(recipe_)},
        // The data order is a function of the seed; the position, of the step.
        {"data", {{"seed", recipe_.train.seed}, {"samples_consumed", step * recipe_.train.global_batch}}},
        {"tokenizer", tokenizer_identity()},
        {"storage", name_of(recipe_.checkpoint.storage)},
        {"files", files}};
    write_commit_record(tmp.string(), std::move(meta));
  }
  // Every rank's files are written and synced (on every node's disk, with local storage): from here
  // on the checkpoint is complete, and each directory commits it.
  world().barrier().wait();
  if (checkpoint_writer()) commit_checkpoint(dir.string(), step, recipe_.checkpoint.keep);
}

int64_t Trainer::restore() {
  const auto candidates = committed_checkpoints(out_.string());
  std::string dir;
  if (!local_storage()) {
    // The newest checkpoint that verifies: the lead rank checks every file once, all ranks take its
    // choice; a damaged one is skipped, saying why.
    for (const auto& candidate : candidates) {
      double ok = 0;
      if (lead()) {
        try {
          verify_checkpoint(candidate);
          ok = 1;
        } catch (const std::exception& e) {
          log(fmt::format("--resume: skipping {}: {}", candidate, e.what()));
        }
      }
      if (sum_over_world({ok})[0] > 0) {
        dir = candidate;
        break;
      }
    }
  } else {
    // Local storage: each node has its own list of committed checkpoints, and every rank checks the
    // files its node holds. The step to resume from is the newest that every rank has verified:
    // the least of the ranks' newest, or, when some rank lacks that one, the same below it.
    std::map<int64_t, std::string> mine;  // step -> directory, verified here
    for (const auto& candidate : candidates) {
      try {
        verify_checkpoint(candidate, /*present_only=*/true);
        mine[read_json_file((fs::path(candidate) / "trainer.json").string()).at("step").get<int64_t>()] =
            candidate;
      } catch (const std::exception& e) {
        if (checkpoint_writer())
          std::cout << fmt::format("[node {}] --resume: skipping {}: {}", node_, candidate, e.what())
                    << std::endl;
      }
    }
    for (int64_t below = std::numeric_limits<int64_t>::max();;) {
      auto it = mine.lower_bound(below);
      const double newest = it == mine.begin() ? -1.0 : double(std::prev(it)->first);
      auto t = at::tensor(std::vector<double>{newest}, at::kDouble).to(device_);
      world().all_reduce(t, {comm::ReduceOp::kMin}).wait();
      const auto step = static_cast<int64_t>(t.cpu().item<double>());
      if (step < 0) break;
      if (sum_over_world({mine.count(step) ? 1.0 : 0.0})[0] == world().size()) {
        dir = mine.at(step);
        break;
      }
      below = step;
    }
  }
  if (dir.empty())
    throw std::runtime_error(
        fmt::format("--resume: none of the {} checkpoints under {}/checkpoints verifies{}", candidates.size(),
                    out_.string(), local_storage() ? " on every node" : ""));
  const json meta = read_json_file((fs::path(dir) / "trainer.json").string());
  if (const auto changes = check_resume_settings(dir, meta, recipe_, options_); !changes.empty())
    log(fmt::format("--resume-with-changes: continuing {} with {}", dir, fmt::join(changes, "; ")));
  const json saved_model = meta.at("model"), now_model = to_json(recipe_.model);
  for (const auto& [k, v] : now_model.items())
    if (!saved_model.contains(k) || saved_model[k] != v)
      throw std::runtime_error(
          fmt::format("--resume: {} was written with model.{} = {}, the recipe now says {}", dir, k,
                      saved_model.contains(k) ? saved_model[k].dump() : "nothing", v.dump()));
  if (recipe_.tokenizer)
    recipe_.tokenizer->check_matches(meta.value("tokenizer", json::object()), "--resume: " + dir);
  for (auto& root : roots_) root->reshard();
  fsdp::read_shard_files(all_shards(), dir, optimizer_.get(), /*present_only=*/local_storage());
  const int64_t step = meta.at("step");
  log(fmt::format("resumed from {} (step {}, saved at dp {} x pp {})", dir, step, meta.value("dp", 0),
                  meta.value("pp", 0)));
  return step;
}

}  // namespace fsdpp::train::detail
