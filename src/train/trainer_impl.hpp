#pragma once
// The trainer's one class, shared by its sources: trainer_setup.cpp (output directory, data, the
// sharded model), trainer_step.cpp (one training step, evaluation), trainer_checkpoints.cpp (save
// and restore) and trainer.cpp (the loop). Private to src/train.

#include <ATen/ATen.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "fsdpp/base/cuda_graph.hpp"
#include "fsdpp/base/files.hpp"
#include "fsdpp/base/thread_team.hpp"
#include "fsdpp/comm/mesh.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdpp/fsdp/checkpoint.hpp"
#include "fsdpp/pipeline/executor.hpp"
#include "fsdpp/train/chat_data.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/report.hpp"
#include "fsdpp/train/run_lock.hpp"
#include "fsdpp/train/sharding.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "fsdpp/train/trainer.hpp"

namespace fsdpp::train::detail {

namespace fs = std::filesystem;

// This process's peak resident memory (what the kernel counts: anonymous and mapped file pages).
double peak_rss_mib();
// Its resident memory now, its own (anonymous) and mapped files' pages (which the kernel may drop),
// from /proc/self/status; zeros where that is not readable.
struct Resident {
  double own_mib = 0, file_mib = 0;
};
Resident resident_now();
using nlohmann::json;
using Clock = std::chrono::steady_clock;

// FSDPP_FAULT (fsdpp/comm/fault.hpp): the trainer's kinds end this rank with SIGKILL.
void maybe_fire(const char* kind, int rank, int64_t step);

// Refuses (or, with --resume-with-changes, returns) what resuming from `dir` with `recipe` changes.
std::vector<std::string> check_resume_settings(const std::string& dir, const json& meta, const Recipe& recipe,
                                               const RunOptions& options);

class Trainer {
 public:
  Trainer(const Recipe& r, comm::Comm world, const RunOptions& o);

  RunResult run();

 private:
  comm::Comm& world() { return mesh_.world(); }
  bool lead() const { return rank_ == 0; }
  // Checkpoints on local storage: each node's disk holds its own ranks' files, and the node's first
  // rank manages the directory there (rank 0 does on shared storage).
  bool local_storage() const { return recipe_.checkpoint.storage == CheckpointStorage::kLocal; }
  bool checkpoint_writer() const { return local_storage() ? local_rank_ == 0 : lead(); }
  // The dp ranks are dp_replicate groups of dp_shard (HSDP); data is split over all of them.
  int dp_rank() const {
    return mesh_.coord("dp_replicate") * recipe_.parallel.dp_shard() + mesh_.coord("dp_shard");
  }
  // With HSDP every replica group holds the same shards: one of them counts in the gradient norm
  // and writes checkpoints.
  bool first_replica() const { return mesh_.coord("dp_replicate") == 0; }
  bool holds_last_stage() const {
    return !recipe_.plan || stage_ids_.back() == recipe_.plan->spec.num_stages() - 1;
  }
  void log(const std::string& line) {
    if (lead()) progress_.print(line);
  }

  void prepare_output();
  void load_data();
  void build();
  // Validation loss (nats per token) in bits per byte of text.
  double bits_per_byte(double nats_per_token) const {
    return nats_per_token / std::log(2.0) / val_bytes_per_token_;
  }
  json tokenizer_identity() const {
    return recipe_.tokenizer ? recipe_.tokenizer->identity() : json{{"spec", recipe_.data.tokenizer}};
  }
  double train_step(int64_t step);
  void fill_inputs(int64_t step);
  at::Tensor step_body();
  void make_thread_models();
  // The step's microbatches on cpu.microbatch_threads threads; adds their losses to loss_sum.
  void microbatches_on_threads(at::Tensor& loss_sum);
  double evaluate();
  // The loop's reports (trainer.cpp).
  void open_metrics(int64_t step);
  void write_trace(int64_t first, int64_t last, std::chrono::system_clock::time_point begin);
  void report_step(int64_t step, int64_t end, double loss, double tokens_per_s, double elapsed_s);
  void report_evaluation(int64_t step, RunResult& result);
  void write_summary(const RunResult& result, int64_t steps_run, double step_ms_median);
  void save_checkpoint(int64_t step);
  void write_checkpoint(int64_t step, const std::filesystem::path& tmp);
  int64_t restore();
  std::vector<fsdp::Shard> all_shards() {
    std::vector<fsdp::Shard> out;
    for (auto& root : roots_)
      for (auto& s : fsdp::shards(*root.ptr())) out.push_back(std::move(s));
    return out;
  }
  // This rank's parameter memory in MiB: its shards, and the most one block holds while gathered
  // (the block's unit with its experts' unit), over all blocks and over the MoE blocks.
  json parameter_memory() {
    double sharded = 0;
    std::map<int64_t, double> gathered;  // layer -> bytes
    for (auto& root : roots_)
      for (fsdp::Unit* u : root->fsdp_unit().tree_units()) {
        for (const auto& p : u->group().sharded_parameters()) sharded += double(p.numel() * p.element_size());
        if (u->prefix().rfind("layers.", 0) == 0)
          gathered[std::stoll(u->prefix().substr(7))] += double(u->group().unsharded_bytes());
      }
    double block = 0, moe_block = 0;
    for (const auto& [layer, bytes] : gathered) {
      block = std::max(block, bytes);
      if (recipe_.model.is_moe_layer(layer)) moe_block = std::max(moe_block, bytes);
    }
    const double mib = 1 << 20;
    return {{"sharded", sharded / mib},
            {"largest_block_gathered", block / mib},
            {"moe_block_gathered", moe_block / mib}};
  }
  // Sums per-rank figures over the world, in one all-reduce.
  std::vector<double> sum_over_world(std::vector<double> v) {
    auto t = at::tensor(v, at::kDouble).to(device_);
    world().all_reduce(t).wait();
    t = t.cpu();
    return {t.data_ptr<double>(), t.data_ptr<double>() + t.numel()};
  }
  void span(const std::string& name, const std::string& track, std::chrono::system_clock::time_point begin) {
    tracer_.span(name, track, begin, std::chrono::system_clock::now());
  }
  void metric(json j) {
    if (options_.restart > 0) j["restart"] = options_.restart;  // which start of the group wrote the line
    if (metrics_) metrics_->append(j.dump());
  }

  const Recipe& recipe_;
  RunOptions options_;
  std::optional<RunLock> lock_;  // held here only where no launcher of ours holds it
  comm::DeviceMesh mesh_;
  fs::path out_;
  int rank_;
  int local_rank_, local_world_,
      node_;  // LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK, as the launcher or torchrun set them
  Progress progress_;
  Tracer tracer_;

  std::optional<TokenStream> train_data_, val_data_;
  // data.source "chat": conversations whose targets outside the assistant's turns are -100. The loss
  // is then the mean over the counted targets of the whole global batch (Note [counted targets]).
  std::shared_ptr<ChatSamples> chat_train_, chat_val_;
  bool counted_targets() const { return chat_train_ != nullptr; }
  // Per step, on the device: dp / (the global batch's counted targets), the same times the
  // executor's microbatches per step, and the targets this rank's losses count.
  at::Tensor token_scale_, pp_token_scale_, local_targets_;
  double val_bytes_per_token_ = 0;   // 0: unknown (shards from another tool)
  std::vector<ShardedModel> roots_;  // one per stage this rank holds (the whole model when pp = 1)
  std::vector<int> stage_ids_;
  std::optional<pipeline::PipelineExecutor> executor_;
  std::unique_ptr<fsdp::AdamW> optimizer_;
  at::Device device_ = at::kCPU;
  std::vector<at::Tensor> inputs_,
      targets_;  // static inputs: one [micro_batch, seq_len] pair per microbatch of a step
  // Packed conversations: each microbatch's positions (static as the inputs), and those of the
  // executor's current call, which ExecutorOptions::before_forward hands its stages.
  std::vector<at::Tensor> positions_, stage_positions_;
  // cpu.microbatch_threads > 1: the model for each thread past the first, and the threads
  // (made at the first step).
  std::vector<models::MoETransformer> thread_models_;
  // Each copy's parameter beside the sharded model's that it shares storage with.
  std::vector<std::pair<at::Tensor, at::Tensor>> thread_params_;
  std::unique_ptr<ThreadTeam> team_;
  static constexpr int kGraphWarmupSteps = 3;
  int warmup_steps_done_ = 0;
  bool checked_devices_ = false;  // FSDPP_CHECK_DEVICES: the first step ran under DefaultDeviceCheck
  std::unique_ptr<fsdpp::CapturedStep> graph_;
  at::Tensor graph_sums_;  // the captured step's figures, rewritten by every replay
  double current_lr_ = 0;
  std::vector<at::Tensor> params_;
  std::unique_ptr<LineLog> metrics_;
  Series train_series_, val_series_;
  double last_grad_norm_ = 0;
  struct {
    double aux_loss = 0, z_loss = 0, dropped = 0, lr = 0;
  } last_stats_;
};

}  // namespace fsdpp::train::detail
