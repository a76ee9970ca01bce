#pragma once
// The trainer behind `fsdpp run`: trains the recipe's MoE model on this rank's share of the work.
//
// Layout: the world is a DeviceMesh {pp, dp} (dp varies fastest). With pp = 1 the whole model is
// one fully_shard root over dp, and the step is a plain gradient-accumulation loop; with pp > 1
// each pipeline rank holds its stages (contiguous runs of layers, each a fully_shard root over dp)
// and the pipeline executor runs the recipe's schedule. Either way the optimizer (AdamW, no weight
// decay on vectors) updates this rank's shards, after clipping by the global gradient norm.
//
// Output directory (logging.output_dir):
//   recipe.json               the recipe as run (overrides applied, model inline)
//   metrics/rank<r>.jsonl     one JSON object per logged step or evaluation
//   loss.svg                  training and validation loss
//   summary.json              final figures
//   trace.json                with --trace: a few steps of compute and communication, all ranks
//   checkpoints/step-<N>/     rank<r>.safetensors + rank<r>.json (shards, AdamW state), trainer.json
//   checkpoints/latest        name of the newest complete checkpoint
// A checkpoint is written under checkpoints/.tmp-step-<N> and renamed into place once every rank
// has finished, so an interrupted write leaves the previous checkpoint as the latest.

#include <optional>
#include <string>
#include <vector>

#include "dist/comm.hpp"
#include "models/moe.hpp"
#include "train/recipe.hpp"

namespace fsdpp::train {

struct RunOptions {
  bool resume = false;     // continue from the latest checkpoint of the output directory
  bool overwrite = false;  // start afresh even when the output directory holds checkpoints
  bool trace = false;      // write trace.json covering `trace_steps` steps
  int64_t trace_steps = 3;
  std::optional<int64_t> stop_after;  // stop (with a checkpoint) once this many steps are done
  std::optional<bool> tty;            // progress bar; default: stdout is a terminal
  int restart = 0;                    // which restart of the group this is (metrics, summary)
};

struct RunResult {
  int64_t steps_done = 0;
  double train_loss = 0, val_loss = 0;  // last logged, last evaluated (nats per byte)
  double seconds = 0, tokens_per_s = 0;
  std::vector<double> losses;  // training loss of every step this process ran
  std::string output_dir;
};

// Collective over `world` (dp x pp ranks). Throws on bad input before any rank starts work.
RunResult run_training(const Recipe& recipe, dist::Comm world, const RunOptions& options = {});

// Refuses a run that would misuse checkpoints, before any work: --resume without one, or a fresh
// start in an output directory that holds some (without --overwrite).
void check_output_dir(const Recipe& recipe, const RunOptions& options);

// The newest complete checkpoint under an output directory, if any.
std::optional<std::string> latest_checkpoint(const std::string& output_dir);

// Every committed checkpoint under an output directory, newest first (the one `latest` names, then
// the other step-<N> directories that hold a trainer.json, by step).
std::vector<std::string> committed_checkpoints(const std::string& output_dir);

// Checks a checkpoint directory without a model: trainer.json against its own checksum, every file
// it lists (rank indexes) against their sizes and CRC-32C, and every rank's tensor file against its
// index (fsdp::verify_sharded). Throws std::runtime_error naming the file and the damage. Returns
// the number of files and bytes checked. A checkpoint on local storage (or with `present_only`)
// is checked as far as this node's directory holds it.
std::pair<int, uint64_t> verify_checkpoint(const std::string& dir, bool present_only = false);

// Writes one safetensors file of full parameters, under the unwrapped model's names, from a
// checkpoint directory (checkpoints/step-<N>) or an output directory (its latest checkpoint). The
// model config goes to the file's metadata ("fsdpp.model_config"). Returns the checkpoint read.
// Copies full weights (name, tensor) into the model's parameters, converting dtype. Throws naming
// `source` and the tensor when one is not a parameter, has another shape or is not floating point,
// or when a parameter is missing.
void load_full_weights(models::MoETransformerImpl& model, const std::vector<std::pair<std::string, at::Tensor>>& state,
                       const std::string& source);

// Several paths: the directories of one checkpoint on local storage, one per node (each rank's
// files are taken from whichever holds them). Returns the checkpoint directories read.
std::string consolidate_checkpoint(const std::vector<std::string>& paths, const std::string& output_file);
inline std::string consolidate_checkpoint(const std::string& path, const std::string& output_file) {
  return consolidate_checkpoint(std::vector<std::string>{path}, output_file);
}

// An unsharded model with the weights of a checkpoint directory, an output directory or a
// consolidated safetensors file.
models::MoETransformer load_model(const std::string& path);

struct SampleOptions {
  int64_t max_new_bytes = 200;
  double temperature = 0.8;
  int64_t top_k = 40;  // 0: all
  uint64_t seed = 0;
};
// Continues `prompt` byte by byte.
std::string generate(models::MoETransformerImpl& model, const std::string& prompt, const SampleOptions& options);

}  // namespace fsdpp::train
