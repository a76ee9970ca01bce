#pragma once
// Recipes: one JSON file says everything about a training run. Sections map to option structs:
//
//   {
//     "name": "moe-small",                   (default: the file name)
//     "description": "one line for fsdpp ls",
//     "model": "../configs/moe-small.json"   (a path, relative to the recipe, or an inline object),
//     "data": {"source": "fortunes", "seq_len": 128, "val_fraction": 0.05},
//     "parallel": {"dp": 2, "pp": 1, "schedule": "1F1B", "microbatches": 1, "stages_per_rank": 1,
//                  "max_outstanding_sends": 0, "keep_stages_unsharded": true,
//                  "max_active_stages": 3, "unshard_lookahead": "full", "reshard_after_forward": true},
//     "precision": {"param_dtype": "float32", "reduce_dtype": "float32",
//                   "overrides": [{"match": "*.router.gate.weight", "param_dtype": "float32"}]},
//     "optim": {"lr": 3e-3, "min_lr_ratio": 0.1, "warmup_steps": 50, "weight_decay": 0.1,
//               "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0},
//     "train": {"steps": 600, "global_batch": 32, "grad_accum": 1, "seed": 1234,
//               "activation_checkpointing": "none"},
//     "eval": {"interval": 100, "batches": 8},
//     "checkpoint": {"interval": 0, "keep": 2, "storage": "shared"},
//     "logging": {"interval": 10, "metrics": "rank0", "plot": true, "output_dir": "runs/{name}"},
//     "dist": {"watchdog_timeout_s": 300, "check_collectives": false},
//     "cpu": {"microbatch_threads": 1}
//   }
//
// Every key has a default (the values above, from the option structs below). Validation reports
// every problem at once, each naming the JSON path and the rule ("optim.lr: must be in (0, 10], got
// -1"; "optim.lrr: unknown key, did you mean 'lr'?").

#include <c10/core/ScalarType.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdpp/fsdp/mixed_precision.hpp"
#include "fsdpp/models/config.hpp"
#include "fsdpp/pipeline/lowering.hpp"

namespace fsdpp::pipeline {
struct Plan;
}

namespace fsdpp::train {

class Tokenizer;

// All of a recipe's problems, one per line in what().
class RecipeError : public std::invalid_argument {
 public:
  RecipeError(std::string source, std::vector<std::string> problems);
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  std::vector<std::string> problems_;
};

// Settings that take one of a few names in a recipe are enums here, named back by name_of.
enum class DataSource {
  kFortunes,
  kFiles,
  kSynthetic,
  kShards,
  kChat
};                                                 // "fortunes" | "files" | "synthetic" | "shards" | "chat"
enum class Device { kCpu, kCuda };                 // "cpu" (Gloo) | "cuda" (NCCL)
enum class CheckpointStorage { kShared, kLocal };  // "shared" | "local"
enum class MetricsRanks { kRank0, kAll, kNone };   // "rank0" | "all" | "none"
const char* name_of(DataSource v);
const char* name_of(Device v);
const char* name_of(CheckpointStorage v);
const char* name_of(MetricsRanks v);

struct DataOptions {
  DataSource source = DataSource::kFortunes;
  std::vector<std::string> paths;   // files or directories (source "files"); JSONL files (source "chat")
  std::string path;                 // a directory of token shards (source "shards")
  std::string tokenizer = "bytes";  // "bytes", a SentencePiece .model, a tokenizer.json or its directory
  std::string chat_template;        // source "chat": a template file; default: the tokenizer's own
  // Source "chat": several conversations per sample (best fit, longest first), each attending and
  // predicting only within itself (positions restart at each; docs/data.md). Else one per sample.
  bool pack = false;
  int64_t seq_len = 128;
  double val_fraction = 0.05;
  int64_t synthetic_bytes = 1 << 20;
};

struct ParallelOptions {
  int dp = 1, pp = 1;
  // HSDP: the dp ranks as dp_replicate groups of dp / dp_replicate; parameters are sharded within a
  // group and replicated across groups (1: plain FSDP over all dp ranks). The recipe may give
  // dp_shard instead of dp; when it does, dp = dp_replicate x dp_shard.
  int dp_replicate = 1;
  int dp_shard() const { return dp / dp_replicate; }
  // Expert parallelism: each MoE layer's experts spread over groups of ep consecutive ranks of a
  // shard group (ep divides dp_shard and the experts); the expert weights are then sharded over the
  // dp_shard / ep ranks holding the same experts. Data parallelism is unchanged: every dp rank
  // still reads its own part of the batch.
  int ep = 1;
  // The data-parallel ranks of a shard group that hold the same experts.
  int expert_shard() const { return dp_shard() / ep; }
  std::string schedule = "1F1B";  // a registered name, or a .csv / .json action table
  int microbatches = 1;           // per pipeline step (pp > 1)
  int stages_per_rank = 1;
  int max_outstanding_sends = 0;  // 0: unlimited
  // pp > 1: each stage's blocks stay gathered from the plan's UNSHARD to its RESHARD (one
  // all-gather per block per step); false gathers them again for every microbatch (less memory).
  bool keep_stages_unsharded = true;
  // pp > 1: how many of a rank's stages stay gathered at once, and how far ahead of use each rank
  // gathers them (pipeline::PlanOptions; PyTorch 2.15's max_active_stages and unshard_lookahead).
  int max_active_stages = 3;
  pipeline::UnshardLookahead unshard_lookahead;
  // pp > 1: false waits for each stage's reduce-scatters right after issuing them, as PyTorch 2.15
  // does by default; true waits before the rank's next stage reduces (or at the end of the step),
  // overlapping the computations in between (pipeline::PlanOptions::defer_reduce_grad_wait).
  bool defer_reduce_grad_wait = false;
  // pp > 1: false posts each receive as soon as the sender's send is in the plan, PyTorch 2.15's
  // default; true right before the computation that uses it (pipeline::PlanOptions::defer_pp_recv).
  bool defer_pp_recv = false;
  // pp = 1: true frees each block's gathered parameters after its forward and gathers them again
  // for backward (least memory; 2 all-gathers per block and microbatch). false gathers each block
  // once per step and keeps it until the step's last backward (the whole model's parameters held,
  // as under DDP; one all-gather and one reduce-scatter per block and step). With pp > 1 the plan
  // decides (keep_stages_unsharded, which false contradicts when that is false).
  bool reshard_after_forward = true;
};

struct DtypeOverride {
  std::string match;  // a glob on parameter names
  std::optional<at::ScalarType> param_dtype;
  std::optional<fsdp::GradDtype> grad_dtype;  // null in the recipe: none
};

// Dtypes are named float32, bfloat16 or float16 in the recipe.
struct PrecisionOptions {
  at::ScalarType param_dtype = at::kFloat;  // of the gathered parameters and the activations
  // Of the reduce-scatters; null in the recipe: unset, each unit's widest gradient dtype.
  std::optional<at::ScalarType> reduce_dtype = at::kFloat;
  std::vector<DtypeOverride> overrides;  // the first that matches a parameter wins
  // What fully_shard gets: the above as a policy, made by parse_recipe.
  fsdp::MixedPrecisionPolicy policy;
};

struct OptimOptions {
  double lr = 3e-3, min_lr_ratio = 0.1, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  int64_t warmup_steps = 50;
  double grad_clip = 1.0;  // 0: off
};

struct TrainOptions {
  int64_t steps = 600, global_batch = 32, grad_accum = 1, seed = 1234;
  Device device = Device::kCpu;  // cuda: one GPU per local rank
  // cuda only: capture one whole step (every microbatch, clipping, the optimizer) as a CUDA graph
  // after warm-up steps, and replay it; needs capacity routing (static shapes) and pp = 1.
  bool cuda_graph = false;
  // Recompute blocks' forwards in backward instead of keeping their activations: the recipe says
  // "none" (0), "full" (1: every block) or k (every block whose layer index is a multiple of k).
  int64_t activation_checkpointing = 0;
};

struct EvalOptions {
  int64_t interval = 100, batches = 8;  // interval 0: only at the end
};

struct CheckpointOptions {
  bool enabled = true;   // false: no checkpoints at all (benchmarks)
  int64_t interval = 0;  // 0: only at the end
  int64_t keep = 2;
  // "shared": one directory every rank sees. "local": each node writes its own ranks' files to its
  // own disk (the same path on every node); the commit is agreed by all ranks, and resuming takes
  // the newest step every node committed (at the same dp x pp).
  CheckpointStorage storage = CheckpointStorage::kShared;
};

struct LoggingOptions {
  int64_t interval = 10;
  MetricsRanks metrics = MetricsRanks::kRank0;  // which ranks write metrics/rank<r>.jsonl
  bool plot = true;
  std::string output_dir = "runs/{name}";
};

struct DistOptions {
  double watchdog_timeout_s = 300;  // an operation in flight longer: dump flight records, end the run; 0: off
  bool check_collectives = false;   // compare every collective across ranks before issuing it
};

// Settings of CPU runs, each kept because it measurably helps on some recipe (docs/performance.md,
// bench/results/knobs.md).
struct CpuOptions {
  // pp = 1: how many of a step's microbatches (train.grad_accum) run at once, each on its own
  // thread with one intra-op thread, instead of one after the other with every operator on the
  // rank's threads. Every block is gathered once per step and kept to the step's end, each thread
  // but the first runs a copy of the model over the gathered parameters with gradients of its own,
  // and the gradients are reduced once after the last microbatch: memory for as many
  // microbatches' activations and gradients as threads. `fsdpp run` shortens OpenMP's idle spin
  // for such runs (fsdpp/base/openmp_wait.hpp).
  int microbatch_threads = 1;
};

struct Recipe {
  std::string name;
  std::string source;  // file path, for messages
  models::MoEConfig model;
  DataOptions data;
  ParallelOptions parallel;
  PrecisionOptions precision;
  OptimOptions optim;
  TrainOptions train;
  EvalOptions eval;
  CheckpointOptions checkpoint;
  LoggingOptions logging;
  DistOptions dist;
  CpuOptions cpu;
  // model.init_from: a safetensors file of full weights under the model's parameter names (as
  // `fsdpp ckpt consolidate` or safetensors.torch.save_file write them) to start from instead of
  // the seeded initialisation; empty for none. Ignored on --resume (the checkpoint wins).
  std::string init_from;
  nlohmann::json resolved;  // the recipe after overrides, with the model inline
  // pp > 1: the lowered schedule, made and checked once by parse_recipe (null with pp = 1).
  std::shared_ptr<const pipeline::Plan> plan;
  // data.tokenizer, loaded (validation checks its vocabulary against the model's).
  std::shared_ptr<const Tokenizer> tokenizer;

  std::string output_dir() const;  // logging.output_dir with {name} filled in
  int world_size() const { return parallel.dp * parallel.pp; }
  // Sequences each dp rank processes per forward (microbatch).
  int64_t micro_batch() const;
};

// Reads and validates a recipe file, after applying `overrides` ("optim.lr=1e-3": the value is
// JSON when it parses as JSON, else a string). `world_size`, when known (launched, or --nproc),
// must equal dp x pp. Throws RecipeError.
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {},
                   std::optional<int> world_size = std::nullopt);

// The precision.overrides patterns that match no parameter of the recipe's model, as
// "precision.overrides[1].match \"*gate*\"": such a pattern (a typo, another model's names)
// changes nothing, silently. Names come from a model of the same structure built at a tiny size.
std::vector<std::string> unmatched_overrides(const Recipe& recipe);

// The same for a JSON value; relative model paths resolve against `base_dir`.
Recipe parse_recipe(nlohmann::json j, const std::string& source, const std::string& base_dir,
                    const std::vector<std::string>& overrides = {},
                    std::optional<int> world_size = std::nullopt);

// A model config file or object; throws RecipeError.
models::MoEConfig parse_model_config(const nlohmann::json& j, const std::string& source);
nlohmann::json to_json(const models::MoEConfig& c);

// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace fsdpp::train
