#include "fsdpp/train/trainer.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "fsdpp/comm/fault.hpp"
#include "fsdpp/comm/mesh.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdpp/fsdp/checkpoint.hpp"
#include "fsdpp/base/cpu_binding.hpp"
#include "fsdpp/base/host_memory.hpp"
#include "fsdpp/base/mkl_dispatch.hpp"
#include "fsdpp/base/mkl_vml.hpp"
#include "fsdpp/base/openmp_wait.hpp"
#include "fsdpp/base/cuda_graph.hpp"
#include "fsdpp/base/device_check.hpp"
#include "fsdpp/base/files.hpp"
#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/base/thread_team.hpp"
#include "fsdpp/pipeline/executor.hpp"
#include "fsdpp/pipeline/fsdp_stage.hpp"
#include "fsdpp/train/activation_checkpoint.hpp"
#include "fsdpp/train/checkpoints.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/report.hpp"
#include "fsdpp/train/run_lock.hpp"
#include "fsdpp/train/sharding.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// This process's peak resident memory (what the kernel counts: anonymous and mapped file pages).
double peak_rss_mib() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

// Linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step.
double learning_rate(const OptimOptions& o, int64_t step, int64_t total) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  const double progress = std::min(1.0, double(step - o.warmup_steps) / double(std::max<int64_t>(1, total - o.warmup_steps)));
  return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// FSDPP_FAULT (fsdpp/comm/fault.hpp): the trainer's kinds end this rank with SIGKILL.
void maybe_fire(const char* kind, int rank, int64_t step) {
  if (!comm::injected_fault().due(kind, rank, step)) return;
  std::cerr << fmt::format("FSDPP_FAULT: rank {} kills itself ({} at step {})", rank, kind, step) << std::endl;
  raise(SIGKILL);
}

// An integer from the environment, or `fallback` when it is unset.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

bool stdout_is_terminal() {
  if (const char* e = std::getenv("FSDPP_STDOUT_TTY")) return std::string(e) == "1";
  return isatty(STDOUT_FILENO);
}

// Refuses (or, with --resume-with-changes, returns) what resuming from `dir` with `recipe` changes.
std::vector<std::string> check_resume_settings(const std::string& dir, const json& meta, const Recipe& recipe,
                                               const RunOptions& options) {
  // Checkpoints from before resume_settings were recorded are not compared.
  if (!meta.contains("resume_settings")) return {};
  const auto changes = resume_changes(meta["resume_settings"], resume_settings(recipe));
  if (!changes.empty() && !options.resume_with_changes)
    throw std::runtime_error(fmt::format(
        "--resume: {} was written with other settings, which its data order or optimizer state depend on:\n  {}\n"
        "resume with the recipe it was written with, or pass --resume-with-changes to continue with these changes",
        dir, fmt::join(changes, "\n  ")));
  return changes;
}

class Trainer {
 public:
  Trainer(const Recipe& r, comm::Comm world, const RunOptions& o)
      : recipe_(r), options_(o), mesh_(std::move(world), {{"pp", r.parallel.pp}, {"dp_replicate", r.parallel.dp_replicate}, {"dp_shard", r.parallel.dp_shard()}}),
        out_(r.output_dir()), rank_(mesh_.world().rank()), local_rank_(env_int("LOCAL_RANK", rank_)),
        local_world_(env_int("LOCAL_WORLD_SIZE", mesh_.world().size())),
        node_(env_int("GROUP_RANK", 0)),
        progress_(r.train.steps, o.tty.value_or(stdout_is_terminal()), std::cout), tracer_(rank_) {}

  RunResult run();

 private:
  comm::Comm& world() { return mesh_.world(); }
  bool lead() const { return rank_ == 0; }
  // Checkpoints on local storage: each node's disk holds its own ranks' files, and the node's first
  // rank manages the directory there (rank 0 does on shared storage).
  bool local_storage() const { return recipe_.checkpoint.storage == "local"; }
  bool checkpoint_writer() const { return local_storage() ? local_rank_ == 0 : lead(); }
  // The dp ranks are dp_replicate groups of dp_shard (HSDP); data is split over all of them.
  int dp_rank() const { return mesh_.coord("dp_replicate") * recipe_.parallel.dp_shard() + mesh_.coord("dp_shard"); }
  // With HSDP every replica group holds the same shards: one of them counts in the gradient norm
  // and writes checkpoints.
  bool first_replica() const { return mesh_.coord("dp_replicate") == 0; }
  bool holds_last_stage() const { return !recipe_.plan || stage_ids_.back() == recipe_.plan->spec.num_stages() - 1; }
  void log(const std::string& line) {
    if (lead()) progress_.print(line);
  }

  void prepare_output();
  void load_data();
  void build();
  std::unique_ptr<CpuRotation> start_cpu_rotation(const std::vector<int>& cpus);
  // Validation loss (nats per token) in bits per byte of text.
  double bits_per_byte(double nats_per_token) const { return nats_per_token / std::log(2.0) / val_bytes_per_token_; }
  json tokenizer_identity() const {
    return recipe_.tokenizer ? recipe_.tokenizer->identity() : json{{"spec", recipe_.data.tokenizer}};
  }
  double train_step(int64_t step);
  void fill_inputs(int64_t step);
  at::Tensor step_body();
  void make_thread_models();
  // The step's microbatches on parallel.microbatch_threads threads; adds their losses to loss_sum.
  void microbatches_on_threads(at::Tensor& loss_sum);
  double evaluate();
  void save_checkpoint(int64_t step);
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
    return {{"sharded", sharded / mib}, {"largest_block_gathered", block / mib}, {"moe_block_gathered", moe_block / mib}};
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
  int local_rank_, local_world_, node_;  // LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK, as the launcher or torchrun set them
  Progress progress_;
  Tracer tracer_;

  std::optional<TokenStream> train_data_, val_data_;
  double val_bytes_per_token_ = 0;  // 0: unknown (shards from another tool)
  std::vector<ShardedModel> roots_;  // one per stage this rank holds (the whole model when pp = 1)
  std::vector<int> stage_ids_;
  std::optional<pipeline::PipelineExecutor> executor_;
  std::unique_ptr<fsdp::AdamW> optimizer_;
  at::Device device_ = at::kCPU;
  std::vector<at::Tensor> inputs_, targets_;  // static inputs: one [micro_batch, seq_len] pair per microbatch of a step
  // parallel.microbatch_threads > 1: the model for each thread past the first, and the threads
  // (made at the first step, so that they start where the computing thread runs, at its nice value).
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

void Trainer::prepare_output() {
  // Under another launcher than `fsdpp run`'s (torchrun, `fsdpp launch -- fsdpp run`), the rank that
  // manages the directory claims it for the run (include/fsdpp/train/run_lock.hpp).
  if (checkpoint_writer() && !std::getenv(RunLock::kHeldVariable)) {
    std::optional<std::string> took_over;
    lock_.emplace(RunLock::acquire(out_.string(), "fsdpp run " + recipe_.source, &took_over));
    if (took_over) std::cerr << "fsdpp run: note: " << *took_over << std::endl;
  }
  check_output_dir(recipe_, options_);
  if (lead()) {
    if (!options_.resume && fs::exists(out_)) {
      for (const char* p : {"checkpoints", "metrics", "trace", "flight_records", "loss.svg", "summary.json", "trace.json"}) fs::remove_all(out_ / p);
    }
    fs::create_directories(out_ / "metrics");
    write_file_atomically((out_ / "recipe.json").string(), recipe_.resolved.dump(2) + "\n");
  }
  if (checkpoint_writer() && !lead()) {  // another node's disk (local storage)
    if (!options_.resume) fs::remove_all(out_ / "checkpoints");
    fs::create_directories(out_);
  }
  world().barrier().wait();
}

void Trainer::load_data() {
  const auto& d = recipe_.data;
  const auto seed = static_cast<uint64_t>(recipe_.train.seed);
  const auto* tok = recipe_.tokenizer.get();
  if (d.source == "shards") {
    auto train = std::make_shared<ShardSet>(d.path, "train", recipe_.model.vocab_size);
    auto val = std::make_shared<ShardSet>(d.path, "val", recipe_.model.vocab_size);
    log(fmt::format("data: {}: train {}; validation {}", d.path, train->description(), val->description()));
    // Bits per byte need the text's size: the index records it (other tools' shards do not).
    const auto& split = val->index().is_object() ? val->index()["splits"]["val"] : json();
    if (split.is_object() && split.value("bytes", 0) > 0)
      val_bytes_per_token_ = double(split["bytes"].get<int64_t>()) / double(split["tokens"].get<int64_t>());
    train_data_.emplace(std::move(train), d.seq_len, seed);
    val_data_.emplace(std::move(val), d.seq_len, 0, /*shuffle=*/false);
    return;
  }
  Corpus corpus = load_corpus(d, seed);
  const auto t0 = Clock::now();
  const size_t val_bytes = corpus.val.size();
  std::vector<std::string> texts;
  texts.push_back(std::move(corpus.train));
  texts.push_back(std::move(corpus.val));
  auto encoded = encode_all(*tok, texts);
  auto& train = encoded[0];
  auto& val = encoded[1];
  val_bytes_per_token_ = double(val_bytes) / double(std::max<size_t>(1, val.size()));
  log(fmt::format("data: {}{}", corpus.description,
                  d.tokenizer == "bytes" ? ""
                                         : fmt::format("; tokenized with {} in {:.1f} s: {:.2f} M tokens, {:.2f} bytes/token",
                                                       d.tokenizer, std::chrono::duration<double>(Clock::now() - t0).count(),
                                                       double(train.size() + val.size()) / 1e6, val_bytes_per_token_)));
  train_data_.emplace(std::move(train), d.seq_len, seed);
  val_data_.emplace(std::move(val), d.seq_len, 0, /*shuffle=*/false);
}

void Trainer::build() {
  const auto& c = recipe_.model;
  if (const auto unmatched = unmatched_overrides(recipe_); !unmatched.empty())
    log(fmt::format("warning: {} matches no parameter of this model, and changes nothing", fmt::join(unmatched, ", ")));
  load_data();

  if (recipe_.train.device == "cuda") device_ = at::Device(at::kCUDA, fsdpp::current_cuda_device());
  // Every rank builds the same full model from the seed (on the CPU, so that every device starts
  // from the same numbers), then keeps its part.
  at::manual_seed(static_cast<uint64_t>(recipe_.train.seed));
  auto full = models::MoETransformer(c);
  if (!recipe_.init_from.empty() && !options_.resume) {
    load_full_weights(*full, read_safetensors(recipe_.init_from).tensors, recipe_.init_from);
    log(fmt::format("model: weights from {}", recipe_.init_from));
  }
  full->to(device_);
  const auto& par = recipe_.parallel;
  auto& dp = mesh_.comm("dp_shard");
  std::optional<ExpertSharding> experts;
  if (par.ep > 1) {
    // Groups of ep consecutive ranks of the shard group exchange tokens; the ranks at the same
    // place in each group hold the same experts and shard them.
    const int d = mesh_.coord("dp_shard");
    experts = ExpertSharding{.ep = dp.split(d / par.ep, d), .shard = dp.split(d % par.ep, d)};
    full->set_expert_parallel(experts->ep);
  }
  fsdp::FullyShardOptions options;
  options.mp = recipe_.precision.policy;
  options.static_buffers = recipe_.train.cuda_graph;
  if (!recipe_.parallel.reshard_after_forward) options.reshard_after_forward = false;
  if (recipe_.parallel.dp_replicate > 1) options.replicate = mesh_.comm("dp_replicate");
  if (!recipe_.plan) {
    roots_.push_back(shard_model(full, dp, options, recipe_.train.activation_checkpointing, experts));
    stage_ids_.push_back(0);
  } else {
    const auto& plan = *recipe_.plan;
    const int stages = plan.spec.num_stages();
    std::vector<pipeline::PipelineStage> mine;
    roots_.reserve(stages);
    for (int st = 0; st < stages; ++st) {
      if (plan.owner[st] != mesh_.coord("pp")) continue;
      const int64_t first = c.layers * st / stages, last = c.layers * (st + 1) / stages;
      roots_.push_back(shard_model(models::MoETransformer(std::make_shared<models::MoETransformerImpl>(*full, first, last)),
                                   dp, options, recipe_.train.activation_checkpointing, experts));
      stage_ids_.push_back(st);
      auto* root = roots_.back().ptr().get();
      mine.push_back({.index = st,
                      .forward = [root](const at::Tensor& x) { return root->forward(x); },
                      .parameters = root->parameters(),
                      .sharding = pipeline::fsdp_sharding(*root)});
    }
    executor_.emplace(plan, mesh_.comm("pp"), std::move(mine), models::lm_loss,
                      pipeline::ExecutorOptions{
                          .activation_shape = {recipe_.micro_batch(), recipe_.data.seq_len, c.dim},
                          .activation_dtype = recipe_.precision.param_dtype,
                          .device = device_,
                          .keep_stages_unsharded = par.keep_stages_unsharded,
                          .loss_scale = 1.0 / double(recipe_.train.grad_accum * par.microbatches),
                          // Each stage's computations in the trace, in PyTorch's notation (0F3).
                          .on_compute =
                              [this](const pipeline::Action& a, std::chrono::system_clock::time_point begin,
                                     std::chrono::system_clock::time_point end) {
                                if (tracer_.active()) tracer_.span(pipeline::to_string(a), "compute", begin, end);
                              },
                      });
  }
  full = nullptr;  // parts of other stages
  if (par.microbatch_threads > 1) make_thread_models();
  const int64_t per_step = recipe_.train.grad_accum * (par.pp > 1 ? par.microbatches : 1);
  for (int64_t i = 0; i < per_step; ++i) {
    inputs_.push_back(at::zeros({recipe_.micro_batch(), recipe_.data.seq_len}, at::TensorOptions(device_).dtype(at::kLong)));
    targets_.push_back(at::zeros_like(inputs_.back()));
  }

  // No weight decay on vectors (norm weights).
  std::vector<at::Tensor> decay, no_decay;
  for (auto& s : all_shards()) {
    (s.info.global_shape.size() >= 2 ? decay : no_decay).push_back(s.param);
    params_.push_back(s.param);
  }
  fsdp::AdamWOptions opts;
  opts.lr = recipe_.optim.lr;
  opts.beta1 = recipe_.optim.beta1;
  opts.beta2 = recipe_.optim.beta2;
  opts.eps = recipe_.optim.eps;
  opts.weight_decay = recipe_.optim.weight_decay;
  optimizer_ = std::make_unique<fsdp::AdamW>(std::move(decay), opts, std::move(no_decay));
  log(fmt::format("model: {:.2f}M parameters ({} layers, dim {}, {} experts top-{}, {} routing); dp {} x pp {}{}{}",
                  double(c.parameter_count()) / 1e6, c.layers, c.dim, c.experts, c.top_k, c.routing, par.dp, par.pp,
                  par.ep > 1 ? fmt::format(", experts over ep {} ({} per rank)", par.ep, c.experts / par.ep) : "",
                  par.pp > 1 ? fmt::format(", schedule {} with {} microbatches", par.schedule, par.microbatches) : ""));
  if (const int64_t every = recipe_.train.activation_checkpointing; every > 0)
    log(every == 1 ? std::string("activation checkpointing: every block recomputes its forward in backward")
                   : fmt::format("activation checkpointing: every {}-th block (layers 0, {}, ...) recomputes its forward "
                                 "in backward", every, every));
}

// Note [capturable step]
// A step is split in two. fill_inputs() runs on the host: the learning rate and this step's
// tokens go into tensors that exist for the whole run (the static inputs). step_body() then does
// everything else (every microbatch's forward and backward with fully_shard's collectives or the
// pipeline schedule, clipping, the optimizer) and reads no device value on the host: losses,
// router statistics and the clipping norm stay in device tensors, gathered into one all-reduce,
// and are read after the step. So on a GPU the body can be captured once as a CUDA graph and
// replayed (train.cuda_graph). On any device it issues the same collectives in the same order
// every step (train.run checks that from traces; tests/train/test_capture.cpp checks fully_shard's
// and the optimizer's fixed addresses).

// parallel.microbatch_threads: the copies of the model that the threads past the first run. A
// copy's parameters are the sharded model's, name for name, as tensors of their own over the same
// storage (set_data): the bytes a unit's all-gather fills (Note [unshard by storage resize]) are
// the ones the copy reads, while its gradients and router statistics are its own.
void Trainer::make_thread_models() {
  const auto named = roots_.front()->inner().named_parameters();
  for (int t = 1; t < recipe_.parallel.microbatch_threads; ++t) {
    auto copy = models::MoETransformer(recipe_.model);
    if (const int64_t every = recipe_.train.activation_checkpointing; every > 0)
      copy->wrap_blocks([every](const models::Block& block, int64_t layer) {
        return checkpoints_layer(every, layer) ? torch::nn::AnyModule(Checkpoint(torch::nn::AnyModule(block)))
                                               : torch::nn::AnyModule(block);
      });
    at::NoGradGuard g;
    const auto own = copy->named_parameters();
    if (own.size() != named.size())
      throw std::logic_error(fmt::format("microbatch threads: a copy of the model has {} parameters, the sharded model {}",
                                         own.size(), named.size()));
    for (const auto& item : own) {
      const at::Tensor* p = named.find(item.key());
      if (!p)
        throw std::logic_error(fmt::format("microbatch threads: the sharded model has no parameter '{}'", item.key()));
      item.value().set_data(p->detach());
      thread_params_.emplace_back(item.value(), *p);
    }
    thread_models_.push_back(std::move(copy));
  }
  log(fmt::format("microbatch threads: {} microbatches at once, one thread each, each operator on one thread",
                  recipe_.parallel.microbatch_threads));
}

// Every unit is gathered once, before the threads start, and stays gathered until all are done: no
// collective runs while they compute. Thread 0 runs the sharded model (its hooks keep the
// gradients unreduced: gradient sync is off), thread t > 0 the copy thread_models_[t - 1]; thread
// t runs microbatches t, t + n, ... Then the copies' gradients join the sharded model's, every
// unit's gradients are reduce-scattered, and the units are resharded for the optimizer step.
void Trainer::microbatches_on_threads(at::Tensor& loss_sum) {
  auto& root = roots_.front();
  const int n = recipe_.parallel.microbatch_threads;
  const int64_t accum = recipe_.train.grad_accum;
  if (!team_) team_ = std::make_unique<ThreadTeam>(n);
  for (auto& copy : thread_models_) {
    copy->router_stats().reset();
    copy->router_stats().aux_grad_scale = 1.0 / double(accum);
  }
  root->inner().router_stats().aux_grad_scale = 1.0 / double(accum);
  root->set_requires_gradient_sync(false);
  root->set_reshard_after_forward(false);
  root->set_reshard_after_backward(false);
  root->unshard();

  const auto b0 = std::chrono::system_clock::now();
  std::vector<at::Tensor> sums(n);
  std::vector<std::chrono::system_clock::time_point> ends(n);  // each thread's, for the trace
  const int intra_op = at::get_num_threads();
  team_->run([&](int t) {
    at::set_num_threads(1);  // OpenMP's (and MKL's) thread count is the calling thread's own
    auto sum = at::zeros({}, loss_sum.options());
    for (int64_t j = t; j < accum; j += n) {
      const auto logits = t == 0 ? root->forward(inputs_[j]) : thread_models_[t - 1]->forward(inputs_[j]);
      const auto loss = models::lm_loss(logits, targets_[j]);
      (loss / double(accum)).backward();
      sum.add_(loss.detach().to(at::kDouble));
    }
    sums[t] = sum;
    ends[t] = std::chrono::system_clock::now();
  });
  at::set_num_threads(intra_op);
  span(fmt::format("forward and backward, {} threads", n), "compute", b0);
  if (tracer_.active())  // one track per thread: a thread that finishes early shows as a gap on its track
    for (int t = 0; t < n; ++t)
      tracer_.span(fmt::format("forward and backward, thread {}", t), fmt::format("microbatch thread {}", t), b0, ends[t]);

  at::NoGradGuard g;
  for (const auto& sum : sums) loss_sum.add_(sum);
  for (const auto& [copy, param] : thread_params_) {
    auto& grad = copy.mutable_grad();
    if (!grad.defined()) continue;  // a parameter this thread's microbatches did not reach
    auto& to = param.mutable_grad();
    if (to.defined()) to.add_(grad);
    else to = std::move(grad);
    grad = at::Tensor();
  }
  for (fsdp::Unit* u : root->fsdp_unit().tree_units()) u->group().accumulate_grads();
  root->fsdp_unit().reduce_grads_async();
  root->fsdp_unit().wait_reduce_grads();
  root->reshard();
  root->set_reshard_after_forward(std::nullopt);
  root->set_reshard_after_backward(true);
  root->set_requires_gradient_sync(true);
}

void Trainer::fill_inputs(int64_t step) {
  current_lr_ = learning_rate(recipe_.optim, step, recipe_.train.steps);
  optimizer_->set_lr(current_lr_);
  const int64_t B = recipe_.train.global_batch, mb = recipe_.micro_batch(), T = recipe_.data.seq_len;
  const int64_t base = step * B + dp_rank() * (B / recipe_.parallel.dp);
  const int64_t count = int64_t(inputs_.size());
  for (int64_t i = 0; i < count; ++i) {
    const auto batch = train_data_->samples(base + i * mb, mb);
    inputs_[i].copy_(batch.narrow(1, 0, T));
    targets_[i].copy_(batch.narrow(1, 1, T));
  }
}

at::Tensor Trainer::step_body() {
  const int64_t accum = recipe_.train.grad_accum;
  for (auto& root : roots_) root->inner().router_stats().reset();
  optimizer_->zero_grad();
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device_);
  auto loss_sum = at::zeros({}, f64);
  double losses = 0;  // how many losses loss_sum holds; the same every step
  if (!executor_ && !thread_models_.empty()) {
    microbatches_on_threads(loss_sum);
    losses += double(accum);
  } else if (!executor_) {
    auto& root = roots_.front();
    root->inner().router_stats().aux_grad_scale = 1.0 / double(accum);
    for (int64_t j = 0; j < accum; ++j) {
      root->set_requires_gradient_sync(j + 1 == accum);
      // Blocks kept gathered through forward stay so through the no-sync microbatches too.
      if (!recipe_.parallel.reshard_after_forward) root->set_reshard_after_backward(j + 1 == accum);
      auto b0 = std::chrono::system_clock::now();
      const auto loss = models::lm_loss(root->forward(inputs_[j]), targets_[j]);
      span("forward", "compute", b0);
      b0 = std::chrono::system_clock::now();
      (loss / double(accum)).backward();
      span("backward", "compute", b0);
      loss_sum.add_(loss.detach().to(at::kDouble));
      losses += 1;
    }
  } else {
    const int m = recipe_.parallel.microbatches;
    for (auto& root : roots_) root->inner().router_stats().aux_grad_scale = 1.0 / double(accum * m);
    for (int64_t a = 0; a < accum; ++a) {
      const std::vector<at::Tensor> xs(inputs_.begin() + a * m, inputs_.begin() + (a + 1) * m);
      const std::vector<at::Tensor> ys(targets_.begin() + a * m, targets_.begin() + (a + 1) * m);
      const auto b0 = std::chrono::system_clock::now();
      const auto mean_scaled = executor_->step_on_device(xs, ys);  // sum over microbatches of loss / (accum m)
      span("pipeline step", "compute", b0);
      if (holds_last_stage()) loss_sum.add_(mean_scaled * double(accum * m)), losses += m;
    }
  }

  // Clip by the norm over every shard of every rank; the squared norm travels in the same
  // all-reduce as the figures the step reports.
  auto c0 = std::chrono::system_clock::now();
  std::vector<at::Tensor> grads;
  if (first_replica())
    for (auto& p : params_)
      if (p.grad().defined()) grads.push_back(p.grad());
  auto sq = fsdp::squared_sum(grads, device_);
  auto router = at::zeros({5}, f64);  // aux loss, z-loss, dropped, assignments, forwards
  {
    at::NoGradGuard g;
    for (auto& root : roots_)
      if (const auto& st = root->inner().router_stats(); st.sums.defined()) router.add_(st.sums);
    for (auto& copy : thread_models_)
      if (const auto& st = copy->router_stats(); st.sums.defined()) router.add_(st.sums);
  }
  // at::full: a fill on the device, which a capture accepts (a copy from host memory it refuses).
  auto sums = at::cat({at::stack({sq, loss_sum}), at::full({1}, losses, f64), router});
  world().all_reduce(sums).wait();
  if (recipe_.optim.grad_clip > 0) {
    // min(1, clip / norm): multiplying by exactly 1 leaves gradients under the limit unchanged.
    const auto scale = at::clamp_max(recipe_.optim.grad_clip / (sums[0].sqrt() + 1e-6), 1.0);
    at::NoGradGuard g;
    for (auto& p : params_)
      if (p.grad().defined()) p.grad().mul_(scale);
  }
  span("clip", "compute", c0);
  c0 = std::chrono::system_clock::now();
  optimizer_->step();
  span("optimizer", "compute", c0);
  return sums;
}

double Trainer::train_step(int64_t step) {
  fill_inputs(step);
  at::Tensor sums;
  if (!checked_devices_ && std::getenv("FSDPP_CHECK_DEVICES") && std::string(std::getenv("FSDPP_CHECK_DEVICES")) == "1") {
    // Every tensor the step makes must be made on the step's device (include/fsdpp/base/device_check.hpp).
    checked_devices_ = true;
    std::vector<std::string> found;
    {
      fsdpp::DefaultDeviceCheck check;
      sums = step_body();
      found = check.findings();
    }
    if (!found.empty())
      throw std::runtime_error(fmt::format("FSDPP_CHECK_DEVICES: the training step makes tensors on the default "
                                           "device (the CPU, whatever train.device is):\n  {}",
                                           fmt::join(found, "\n  ")));
    log("FSDPP_CHECK_DEVICES: the step makes every tensor on its device");
    if (recipe_.train.cuda_graph) ++warmup_steps_done_;  // it was one of the eager warm-up steps
  } else if (!recipe_.train.cuda_graph) {
    sums = step_body();
  } else if (!graph_) {
    // Eager warm-up steps first: they create gradients, optimizer state and the communicators'
    // buffers, which the captured step then uses in place.
    if (++warmup_steps_done_ <= kGraphWarmupSteps) {
      sums = step_body();
    } else {
      const auto c0 = std::chrono::system_clock::now();
      graph_ = fsdpp::CapturedStep::capture([this] { graph_sums_ = step_body(); });
      span("capture", "compute", c0);
      log(fmt::format("captured one step as a CUDA graph after {} eager steps", kGraphWarmupSteps));
    }
  }
  if (graph_) {
    const auto c0 = std::chrono::system_clock::now();
    graph_->replay();
    span("step (graph replay)", "compute", c0);
    sums = graph_sums_;
  }

  // The step is done: read its figures.
  const auto h = sums.to(at::kCPU);
  const double* v = h.data_ptr<double>();  // sq, loss sum, losses, aux, z, dropped, assignments, forwards
  last_grad_norm_ = std::sqrt(v[0]);
  last_stats_ = {v[3] / std::max(1.0, v[7]), v[4] / std::max(1.0, v[7]), v[6] > 0 ? v[5] / v[6] : 0.0,
                 current_lr_};
  return v[1] / std::max(1.0, v[2]);
}

double Trainer::evaluate() {
  at::NoGradGuard no_grad;
  // Start and end resharded, as every training step does: forward then gathers the parameters as
  // the last step left them (a replayed CUDA graph updates them without the units' host-side state
  // knowing), and the next step finds the units as it expects.
  for (auto& root : roots_) root->reshard();
  const int64_t mb = recipe_.micro_batch(), T = recipe_.data.seq_len;
  const int dp = recipe_.parallel.dp;
  double loss_sum = 0, count = 0;
  // Pipelined: up to one step's microbatches at a time through the executor's forward-only mode
  // (activations cross ranks as in training); the rank holding the last stage holds the losses.
  const int64_t group = executor_ ? recipe_.parallel.microbatches : 1;
  for (int64_t first = 0; first < recipe_.eval.batches; first += group) {
    std::vector<at::Tensor> xs, ys;
    for (int64_t b = first; b < std::min(first + group, recipe_.eval.batches); ++b) {
      // The validation set in order; every rank its own slice of each batch.
      const auto batch = val_data_->samples((b * dp + dp_rank()) * mb, mb).to(device_);
      xs.push_back(batch.narrow(1, 0, T));
      ys.push_back(batch.narrow(1, 1, T));
    }
    if (!executor_) {
      loss_sum += models::lm_loss(roots_.front()->forward(xs[0]), ys[0]).item<double>();
      count += 1;
      continue;
    }
    loss_sum += executor_->forward(xs, ys).item<double>();
    if (holds_last_stage()) count += double(xs.size());
  }
  for (auto& root : roots_) root->reshard();
  const auto sums = sum_over_world({loss_sum, count});
  return sums[0] / std::max(1.0, sums[1]);
}

void Trainer::save_checkpoint(int64_t step) {
  const auto t0 = Clock::now();
  const fs::path dir = out_ / "checkpoints";
  const fs::path tmp = dir / (".tmp-" + step_dir_name(step)), final_dir = dir / step_dir_name(step);
  if (checkpoint_writer()) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  world().barrier().wait();
  // One copy: with HSDP the first replica group's ranks write (files numbered over them), the
  // other groups hold the same shards.
  const int files_world = recipe_.parallel.pp * recipe_.parallel.dp_shard();
  const int file_rank = mesh_.coord("pp") * recipe_.parallel.dp_shard() + mesh_.coord("dp_shard");
  if (first_replica())
    fsdp::write_shard_files(all_shards(), file_rank, files_world, tmp.string(), optimizer_.get());  // written and synced
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
      json f = {{"bytes", static_cast<int64_t>(digests[3 * r])}, {"crc32c", crc_hex(static_cast<uint32_t>(digests[3 * r + 1]))}};
      if (local_storage()) f["node"] = static_cast<int>(digests[3 * r + 2]);
      files[fmt::format("rank{}.json", r)] = f;
    }
    json meta = {{"format", kRunCheckpointFormat}, {"step", step},           {"world_size", world().size()},
                 {"dp", recipe_.parallel.dp},            {"pp", recipe_.parallel.pp},
                 {"dp_replicate", recipe_.parallel.dp_replicate}, {"ep", recipe_.parallel.ep},
                 {"model", to_json(recipe_.model)},
                 {"recipe", recipe_.resolved},
                 {"resume_settings", resume_settings(recipe_)},
                 // The data order is a function of the seed; the position, of the step.
                 {"data", {{"seed", recipe_.train.seed}, {"samples_consumed", step * recipe_.train.global_batch}}},
                 {"tokenizer", tokenizer_identity()},
                 {"storage", recipe_.checkpoint.storage},
                 {"files", files}};
    write_commit_record(tmp.string(), std::move(meta));
  }
  // Every rank's files are written and synced (on every node's disk, with local storage): from here
  // on the checkpoint is complete, and each directory commits it.
  world().barrier().wait();
  if (checkpoint_writer()) commit_checkpoint(dir.string(), step, recipe_.checkpoint.keep);
  log(fmt::format("checkpoint: {} ({:.1f} s)", final_dir.string(), std::chrono::duration<double>(Clock::now() - t0).count()));
  world().barrier().wait();
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
        mine[read_json_file((fs::path(candidate) / "trainer.json").string()).at("step").get<int64_t>()] = candidate;
      } catch (const std::exception& e) {
        if (checkpoint_writer())
          std::cout << fmt::format("[node {}] --resume: skipping {}: {}", node_, candidate, e.what()) << std::endl;
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
    throw std::runtime_error(fmt::format("--resume: none of the {} checkpoints under {}/checkpoints verifies{}",
                                         candidates.size(), out_.string(),
                                         local_storage() ? " on every node" : ""));
  const json meta = read_json_file((fs::path(dir) / "trainer.json").string());
  if (const auto changes = check_resume_settings(dir, meta, recipe_, options_); !changes.empty())
    log(fmt::format("--resume-with-changes: continuing {} with {}", dir, fmt::join(changes, "; ")));
  const json saved_model = meta.at("model"), now_model = to_json(recipe_.model);
  for (const auto& [k, v] : now_model.items())
    if (!saved_model.contains(k) || saved_model[k] != v)
      throw std::runtime_error(fmt::format("--resume: {} was written with model.{} = {}, the recipe now says {}", dir, k,
                                           saved_model.contains(k) ? saved_model[k].dump() : "nothing", v.dump()));
  if (recipe_.tokenizer) recipe_.tokenizer->check_matches(meta.value("tokenizer", json::object()), "--resume: " + dir);
  for (auto& root : roots_) root->reshard();
  fsdp::read_shard_files(all_shards(), dir, optimizer_.get(), /*present_only=*/local_storage());
  const int64_t step = meta.at("step");
  log(fmt::format("resumed from {} (step {}, saved at dp {} x pp {})", dir, step, meta.value("dp", 0), meta.value("pp", 0)));
  return step;
}

// Note [rotating CPUs]. FSDPP_CPU_ROTATION_ALTERNATE_MS rotates only in every other window of that
// length, for bench/run_cpu_rotation_bench.sh to compare both ways within one run.
std::unique_ptr<CpuRotation> Trainer::start_cpu_rotation(const std::vector<int>& cpus) {
  if (recipe_.dist.cpu_rotation_ms <= 0) return nullptr;
  if (recipe_.parallel.microbatch_threads > 1 && local_world_ > 1)
    throw std::invalid_argument(fmt::format(
        "{}: dist.cpu_rotation_ms moves each rank's computing thread and its intra-op threads between the {} local "
        "ranks' CPU shares, but not the threads of parallel.microbatch_threads ({}): set dist.cpu_rotation_ms=0",
        recipe_.source, local_world_, recipe_.parallel.microbatch_threads));
  int64_t alternate_ms = 0;
  if (const char* v = std::getenv("FSDPP_CPU_ROTATION_ALTERNATE_MS"); v && *v) {
    char* end = nullptr;
    alternate_ms = std::strtoll(v, &end, 10);
    if (*end != '\0' || alternate_ms < 0)
      throw std::invalid_argument(
          fmt::format("environment variable FSDPP_CPU_ROTATION_ALTERNATE_MS='{}' is not a whole number of milliseconds", v));
  }
  auto rotation = std::make_unique<CpuRotation>(cpus, local_rank_, local_world_,
                                                std::chrono::milliseconds(recipe_.dist.cpu_rotation_ms),
                                                std::chrono::milliseconds(alternate_ms));
  log(fmt::format("cpu rotation ({} ms): {}{}", recipe_.dist.cpu_rotation_ms, rotation->rotating() ? "rank 0's " : "",
                  rotation->description()));
  return rotation;
}

RunResult Trainer::run() {
  // Before the model exists, so that threads started for it inherit the binding; the communicators
  // and their threads exist already.
  const auto all_cpus = allowed_cpus();
  if (const auto bound = bind_cpus(parse_cpu_binding(recipe_.dist.cpu_binding), local_rank_, local_world_);
      !bound.empty())
    log(fmt::format("cpu binding ({}): {}{}", recipe_.dist.cpu_binding, bound.rfind("not bound", 0) == 0 ? "" : "rank 0's ",
                    bound));
  log("MKL: " + mkl_dispatch().detail);  // Note [MKL's kernels on other vendors' CPUs]
  resolve_mkl_vml_kernels();              // Note [MKL vector math's first calls]: before any thread computes
  log("host memory: " + describe_malloc_thresholds(malloc_environment()));
  log("OpenMP: " + describe_openmp_wait(openmp_wait_environment()));
  prepare_output();
  build();
  // After build, so that ATen's intra-op threads exist and move too; before the computing threads'
  // nice value goes up or their class becomes SCHED_IDLE, which the rotating thread would otherwise
  // inherit.
  const auto rotation = start_cpu_rotation(all_cpus);
  // After build: every communicator (the expert-parallel ones are made there) has its threads.
  if (const auto niced = lower_compute_priority(recipe_.dist.compute_nice); !niced.empty())
    log(fmt::format("compute nice ({}): rank 0's {}", recipe_.dist.compute_nice, niced));
  if (recipe_.dist.compute_policy == "idle") log(fmt::format("compute policy (idle): rank 0's {}", make_compute_idle()));
  if (options_.restart > 0)
    log(fmt::format("restart {}: {}", options_.restart,
                    options_.resume ? "continuing from the latest checkpoint that verifies" : "no checkpoint yet, starting afresh"));
  int64_t step = options_.resume ? restore() : 0;

  const bool write_metrics = recipe_.logging.metrics == "all" || (recipe_.logging.metrics == "rank0" && lead());
  if (write_metrics) {
    // On resume, keep the history up to the checkpoint; what came after it is redone.
    const auto path = out_ / "metrics" / fmt::format("rank{}.jsonl", rank_);
    std::vector<std::string> kept;
    if (options_.resume && fs::exists(path)) {
      std::ifstream in(path);
      for (std::string line; std::getline(in, line);) {
        try {
          const auto j = json::parse(line);
          if (j.value("step", int64_t(0)) > step) continue;
          if (j.contains("loss")) train_series_.emplace_back(j["step"], j["loss"]);
          if (j.contains("val_loss")) val_series_.emplace_back(j["step"], j["val_loss"]);
          kept.push_back(line);
        } catch (const json::exception&) {
          // A line cut short by a crash.
        }
      }
    }
    metrics_ = std::make_unique<LineLog>(path, /*truncate=*/true);
    for (const auto& l : kept) metrics_->append(l);
  }

  const int64_t end = std::min(recipe_.train.steps, options_.stop_after.value_or(recipe_.train.steps));
  const int64_t tokens_per_step = recipe_.train.global_batch * recipe_.data.seq_len;
  const int64_t trace_from = std::min(step + 1, end - 1), trace_to = trace_from + options_.trace_steps;
  std::chrono::system_clock::time_point trace_begin;
  RunResult result;
  std::vector<double> step_seconds;  // of every training step, for the summary's median
  result.output_dir = out_.string();
  log(fmt::format("training: steps {}..{} of {}, {} sequences x {} tokens per step; output in {}", step + 1, end,
                  recipe_.train.steps, recipe_.train.global_batch, recipe_.data.seq_len, out_.string()));

  const auto run_start = Clock::now();
  auto window_start = Clock::now();
  int64_t window_steps = 0, steps_run = 0;
  double tokens_per_s = 0;
  double last_val = std::numeric_limits<double>::quiet_NaN();
  while (step < end) {
    if (options_.trace && step == trace_from) {
      tracer_.set_active(true);
      trace_begin = std::chrono::system_clock::now();
    }
    maybe_fire("kill", rank_, step + 1);
    const auto s0 = std::chrono::system_clock::now();
    const double loss = train_step(step);
    span(fmt::format("step {}", step + 1), "steps", s0);
    step_seconds.push_back(std::chrono::duration<double>(std::chrono::system_clock::now() - s0).count());
    ++step, ++window_steps, ++steps_run;
    result.losses.push_back(loss);
    result.train_loss = loss;
    if (!std::isfinite(loss))
      throw std::runtime_error(fmt::format("step {}: the loss is {} (try a lower optim.lr or optim.grad_clip)", step, loss));

    if (options_.trace && tracer_.active() && (step >= trace_to || step == end)) {
      tracer_.add_communication(trace_begin, std::chrono::system_clock::now());
      tracer_.set_active(false);
      fs::create_directories(out_ / "trace");
      tracer_.write((out_ / "trace" / fmt::format("rank{}.json", rank_)).string());
      world().barrier().wait();
      if (lead()) {
        std::vector<std::string> parts;
        for (int r = 0; r < world().size(); ++r) parts.push_back((out_ / "trace" / fmt::format("rank{}.json", r)).string());
        Tracer::merge(parts, (out_ / "trace.json").string());
        log(fmt::format("trace: {} (steps {}..{}; open in chrome://tracing or ui.perfetto.dev)",
                        (out_ / "trace.json").string(), trace_from + 1, step));
      }
    }

    const bool log_now = step % recipe_.logging.interval == 0 || step == end;
    if (log_now) {
      const double secs = std::chrono::duration<double>(Clock::now() - window_start).count();
      tokens_per_s = double(window_steps * tokens_per_step) / std::max(secs, 1e-9);
      window_start = Clock::now();
      window_steps = 0;
      train_series_.emplace_back(step, loss);
      json m = {{"step", step}, {"loss", loss}, {"lr", last_stats_.lr}, {"grad_norm", last_grad_norm_},
                {"tokens_per_s", tokens_per_s}, {"time_s", std::chrono::duration<double>(Clock::now() - run_start).count()}};
      if (recipe_.model.experts > 0)
        m.update({{"aux_loss", last_stats_.aux_loss}, {"z_loss", last_stats_.z_loss}, {"dropped_fraction", last_stats_.dropped}});
      metric(m);
      if (lead()) {
        const double eta = double(end - step) * double(tokens_per_step) / std::max(tokens_per_s, 1e-9);
        std::string extra = fmt::format("lr {:.2e}", last_stats_.lr);
        if (recipe_.model.routing == "capacity") extra += fmt::format(" | dropped {:.1f}%", 100 * last_stats_.dropped);
        progress_.update(step, loss, tokens_per_s, eta, extra);
      }
    }
    const bool eval_now = (recipe_.eval.interval > 0 && step % recipe_.eval.interval == 0) || step == end;
    if (eval_now) {
      const auto e0 = std::chrono::system_clock::now();
      last_val = evaluate();
      span("eval", "steps", e0);
      result.val_loss = last_val;
      val_series_.emplace_back(step, last_val);
      json m = {{"step", step}, {"val_loss", last_val}};
      if (val_bytes_per_token_ > 0) {
        result.val_bpb = bits_per_byte(last_val);
        m["val_bpb"] = result.val_bpb;
      }
      metric(m);
      log(fmt::format("step {}: validation loss {:.4f} nats/token{}", step, last_val,
                      val_bytes_per_token_ > 0 ? fmt::format(" ({:.3f} bits/byte)", result.val_bpb) : ""));
      if (lead() && recipe_.logging.plot)
        write_loss_svg((out_ / "loss.svg").string(), train_series_, val_series_,
                       fmt::format("{}: loss (nats per token)", recipe_.name));
    }
    if (recipe_.checkpoint.enabled && ((recipe_.checkpoint.interval > 0 && step % recipe_.checkpoint.interval == 0) || step == end))
      save_checkpoint(step);
  }
  progress_.finish();
  result.steps_done = step;
  result.seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
  result.tokens_per_s = double(steps_run * tokens_per_step) / std::max(result.seconds, 1e-9);
  if (lead()) {
    const json summary = {{"recipe", recipe_.name},
                          {"steps", step},
                          {"steps_this_run", steps_run},
                          {"seconds", result.seconds},
                          {"tokens_per_s", result.tokens_per_s},
                          {"step_ms_median", 1e3 * median(step_seconds)},
                          {"train_loss", result.train_loss},
                          {"val_loss", result.val_loss},
                          {"val_bpb", val_bytes_per_token_ > 0 ? json(result.val_bpb) : json()},
                          {"tokenizer", recipe_.data.tokenizer},
                          {"dp", recipe_.parallel.dp},
                          {"pp", recipe_.parallel.pp},
                          {"dp_replicate", recipe_.parallel.dp_replicate},
                          {"ep", recipe_.parallel.ep},
                          {"parameter_mib", parameter_memory()},
                          {"restarts", options_.restart},
                          {"peak_rss_mib", peak_rss_mib()}};
    write_file_atomically((out_ / "summary.json").string(), summary.dump(1) + "\n");
    std::cout << fmt::format("done: {} steps in {} ({:.1f}k tok/s); train loss {:.4f}, validation loss {:.4f} nats/token{}\n"
                             "outputs: {}/ (loss.svg, metrics/, {}summary.json{})",
                             steps_run, format_duration(result.seconds), result.tokens_per_s / 1e3, result.train_loss,
                             result.val_loss,
                             val_bytes_per_token_ > 0 ? fmt::format(" ({:.3f} bits/byte)", result.val_bpb) : "", out_.string(),
                             recipe_.checkpoint.enabled ? fmt::format("checkpoints/{}, ", step_dir_name(step)) : "",
                             options_.trace ? ", trace.json" : "")
              << std::endl;
  }
  return result;
}

}  // namespace

RunResult run_training(const Recipe& recipe, comm::Comm world, const RunOptions& options) {
  if (world.size() != recipe.world_size())
    throw std::invalid_argument(fmt::format("{}: parallel: dp x pp = {} ranks, but the world has {}", recipe.source,
                                            recipe.world_size(), world.size()));
  Trainer t(recipe, std::move(world), options);
  return t.run();
}

void check_output_dir(const Recipe& recipe, const RunOptions& options) {
  const auto out = recipe.output_dir();
  if (options.resume && options.overwrite)
    throw std::invalid_argument("--resume and --overwrite contradict each other: --resume continues the run in " + out +
                                ", --overwrite deletes it; give one");
  const auto all = committed_checkpoints(out);
  const auto latest = all.empty() ? std::nullopt : std::optional<std::string>(all.front());
  if (options.resume && !latest)
    throw std::runtime_error(fmt::format("--resume: no checkpoint under {}/checkpoints to resume from", out));
  if (options.resume) {
    // The latest checkpoint, as far as its record can be read (a damaged one is skipped, with a
    // message, when the ranks restore).
    json meta;
    try {
      meta = read_json_file((fs::path(*latest) / "trainer.json").string());
    } catch (const std::runtime_error&) {
      return;
    }
    check_resume_settings(*latest, meta, recipe, options);
  }
  if (!options.resume && latest && !options.overwrite)
    throw std::runtime_error(fmt::format("{} already holds checkpoints (latest {}); pass --resume to continue that run "
                                         "or --overwrite to start afresh",
                                         out, fs::path(*latest).filename().string()));
}

}  // namespace fsdpp::train
