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
// has finished, so an interrupted write leaves the previous checkpoint as the latest
// (train/checkpoints.hpp). Sources: trainer.cpp (the loop), trainer_setup.cpp (output directory,
// data, the sharded model), trainer_step.cpp (the step, evaluation), trainer_checkpoints.cpp,
// checkpoints.cpp, model_files.cpp.

#include <optional>
#include <string>
#include <vector>

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/train/recipe.hpp"

namespace fsdpp::train {

struct RunOptions {
  bool resume = false;  // continue from the latest checkpoint of the output directory
  // With resume: continue even where the recipe changed what the checkpoint's data order or
  // optimizer depend on (resume_changes in checkpoints.hpp), saying what changed.
  bool resume_with_changes = false;
  bool overwrite = false;  // start afresh even when the output directory holds checkpoints
  bool trace = false;      // write trace.json covering `trace_steps` steps
  int64_t trace_steps = 3;
  std::optional<int64_t> stop_after;  // stop (with a checkpoint) once this many steps are done
  std::optional<bool> tty;            // progress bar; default: stdout is a terminal
  int restart = 0;                    // which restart of the group this is (metrics, summary)
};

struct RunResult {
  int64_t steps_done = 0;
  double train_loss = 0, val_loss = 0;  // last logged, last evaluated (nats per token)
  double val_bpb = 0;                   // the last validation loss in bits per byte of text (0: unknown)
  double seconds = 0, tokens_per_s = 0;
  std::vector<double> losses;  // training loss of every step this process ran
  std::string output_dir;
};

// Collective over `world` (dp x pp ranks). Throws on bad input before any rank starts work.
RunResult run_training(const Recipe& recipe, comm::Comm world, const RunOptions& options = {});

// Refuses a run that would misuse checkpoints, before any work: --resume without one, --resume with
// --overwrite, a fresh start in an output directory that holds some (without --overwrite), or a
// resume whose recipe changes what the latest checkpoint's data order or optimizer depend on
// (without resume_with_changes).
void check_output_dir(const Recipe& recipe, const RunOptions& options);

// With --resume, when the run has already trained every step (its latest checkpoint verifies and
// holds train.steps): what to tell the user instead of starting ranks, which would change nothing
// but the summary. Empty otherwise.
std::optional<std::string> finished_run(const Recipe& recipe, const RunOptions& options);

}  // namespace fsdpp::train
