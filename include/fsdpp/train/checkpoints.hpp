#pragma once
// A training run's checkpoints on disk (layout at the top of train/trainer.hpp): finding them,
// checking them byte by byte, committing a new one, and turning one into a single file of full
// weights. The trainer writes each rank's shards (fsdp/checkpoint.hpp) and uses these for the rest.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp::train {

struct Recipe;

inline constexpr const char* kRunCheckpointFormat = "fsdpp-run-checkpoint-1";

// "step-<N>", zero-padded so that names sort by step.
std::string step_dir_name(int64_t step);

// The checkpoint that an output directory's `latest` names, if it names one that exists.
std::optional<std::string> latest_checkpoint(const std::string& output_dir);

// Every committed checkpoint under an output directory, newest first (the one `latest` names, then
// the other step-<N> directories, by step), damaged or not: verify_checkpoint tells.
std::vector<std::string> committed_checkpoints(const std::string& output_dir);

// A checkpoint directory, given it or an output directory (then its latest). Throws when neither.
std::string find_checkpoint(const std::string& path);

// Checks a checkpoint directory without a model: trainer.json against its own checksum, every file
// it lists (rank indexes) against their sizes and CRC-32C, and every rank's tensor file against its
// index (fsdp::verify_sharded). Throws std::runtime_error naming the file and the damage. Returns
// the number of files and bytes checked. A checkpoint on local storage (or with `present_only`)
// is checked as far as this node's directory holds it. A checkpoint the trainer committed (a
// step-<N> directory of a run) without its trainer.json is damaged; a directory that
// fsdp::save_sharded wrote has none, and its ranks' files are checked alone.
std::pair<int, uint64_t> verify_checkpoint(const std::string& dir, bool present_only = false);

// What a run's checkpoint depends on beyond the model: the data order (train.seed,
// train.global_batch, every data.* setting) and the optimizer's meaning (every optim.* setting, and
// train.steps, which shapes the learning-rate schedule), as effective values (defaults included),
// one key per setting ("train.seed": 1234). Recorded in trainer.json as "resume_settings". Layout
// (parallel.*), logging, evaluation and checkpoint settings may change across a resume.
nlohmann::json resume_settings(const Recipe& recipe);

// What resuming with `now` would change of `recorded` (both as resume_settings gives them): one
// line per change ("train.seed: 1234 -> 7").
std::vector<std::string> resume_changes(const nlohmann::json& recorded, const nlohmann::json& now);

// Writes `meta` as `dir`/trainer.json, atomically, with the CRC-32C of its own contents.
void write_commit_record(const std::string& dir, nlohmann::json meta);

// Commits checkpoints/.tmp-step-<N> (every rank's files written and synced): renames it to
// step-<N>, then points `latest` at it, then removes all but the newest `keep` checkpoints.
void commit_checkpoint(const std::string& checkpoints_dir, int64_t step, int64_t keep);

// Writes one safetensors file of full parameters, under the unwrapped model's names, from a
// checkpoint directory (checkpoints/step-<N>) or an output directory (its latest checkpoint). The
// model config goes to the file's metadata ("fsdpp.model_config"). Several paths: the directories
// of one checkpoint on local storage, one per node (each rank's files are taken from whichever
// holds them). Returns the checkpoint directories read. The output may not be a file of a checkpoint
// of the run, nor its `latest` pointer, nor an existing file unless `overwrite` (std::invalid_argument).
std::string consolidate_checkpoint(const std::vector<std::string>& paths, const std::string& output_file,
                                   bool overwrite = false);
inline std::string consolidate_checkpoint(const std::string& path, const std::string& output_file,
                                          bool overwrite = false) {
  return consolidate_checkpoint(std::vector<std::string>{path}, output_file, overwrite);
}

}  // namespace fsdpp::train
