// The trainer's setup: the output directory, the data, and the model sharded over the mesh.
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "fsdpp/base/storage.hpp"
#include "fsdpp/pipeline/fsdp_stage.hpp"
#include "fsdpp/train/activation_checkpoint.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "trainer_impl.hpp"

namespace fsdpp::train::detail {

namespace {

// An integer from the environment, or `fallback` when it is unset.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

bool stdout_is_terminal() {
  if (const char* e = std::getenv("FSDPP_STDOUT_TTY")) return std::string(e) == "1";
  return isatty(STDOUT_FILENO);
}

}  // namespace

Trainer::Trainer(const Recipe& r, comm::Comm world, const RunOptions& o)
    : recipe_(r),
      options_(o),
      mesh_(std::move(world), {{"pp", r.parallel.pp},
                               {"dp_replicate", r.parallel.dp_replicate},
                               {"dp_shard", r.parallel.dp_shard()}}),
      out_(r.output_dir()),
      rank_(mesh_.world().rank()),
      local_rank_(env_int("LOCAL_RANK", rank_)),
      local_world_(env_int("LOCAL_WORLD_SIZE", mesh_.world().size())),
      node_(env_int("GROUP_RANK", 0)),
      progress_(r.train.steps, o.tty.value_or(stdout_is_terminal()), std::cout),
      tracer_(rank_) {}

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
      for (const char* p :
           {"checkpoints", "metrics", "trace", "flight_records", "loss.svg", "summary.json", "trace.json"})
        fs::remove_all(out_ / p);
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
  if (d.source == DataSource::kShards) {
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
  if (d.source == DataSource::kChat) {
    auto chat = load_chat(d, *tok, seed);
    log("data: " + chat.description);
    chat_train_ = std::move(chat.train);
    chat_val_ = std::move(chat.val);
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
                  d.tokenizer == "bytes"
                      ? ""
                      : fmt::format("; tokenized with {} in {:.1f} s: {:.2f} M tokens, {:.2f} bytes/token",
                                    d.tokenizer, std::chrono::duration<double>(Clock::now() - t0).count(),
                                    double(train.size() + val.size()) / 1e6, val_bytes_per_token_)));
  train_data_.emplace(std::move(train), d.seq_len, seed);
  val_data_.emplace(std::move(val), d.seq_len, 0, /*shuffle=*/false);
}

void Trainer::build() {
  const auto& c = recipe_.model;
  if (const auto unmatched = unmatched_overrides(recipe_); !unmatched.empty())
    log(fmt::format("warning: {} matches no parameter of this model, and changes nothing",
                    fmt::join(unmatched, ", ")));
  load_data();

  if (recipe_.train.device == Device::kCuda) device_ = at::Device(at::kCUDA, fsdpp::current_cuda_device());
  // Every rank builds the same full model from the seed (on the CPU, so that every device starts
  // from the same numbers), then keeps its part. Weights from a file are read by rows once the
  // model is sharded: the model is built unallocated (Note [unallocated parameters]) and each rank
  // reads the rows it keeps.
  at::manual_seed(static_cast<uint64_t>(recipe_.train.seed));
  const bool from_file = !recipe_.init_from.empty() && !options_.resume;
  std::vector<LazyTensor> weights;
  if (from_file) weights = read_weights_by_rows(recipe_.init_from);
  auto full = models::MoETransformer(c, from_file ? models::Weights::kUnallocated : models::Weights::kRandom);
  if (from_file) {
    check_full_weights(*full, weights, recipe_.init_from);
    if (!device_.is_cpu())
      for (auto& p : full->parameters())
        p.set_data(unallocated_tensor(p.sizes(), p.options().device(device_)));
  } else {
    full->to(device_);
  }
  const auto& par = recipe_.parallel;
  auto& dp = mesh_.comm("dp_shard");
  std::optional<ExpertSharding> experts;
  if (par.ep > 1) {
    // Groups of ep consecutive ranks of the shard group exchange tokens; the ranks at the same
    // place in each group hold the same experts and shard them.
    const int d = mesh_.coord("dp_shard");
    experts = ExpertSharding{.ep = dp.split(d / par.ep, d), .shard = dp.split(d % par.ep, d)};
    apply_expert_parallel(*full, experts->ep);
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
      roots_.push_back(shard_model(
          models::MoETransformer(std::make_shared<models::MoETransformerImpl>(*full, first, last)), dp,
          options, recipe_.train.activation_checkpointing, experts));
      stage_ids_.push_back(st);
      auto* root = roots_.back().ptr().get();
      mine.push_back({.index = st,
                      .forward = [root](const at::Tensor& x) { return root->forward(x); },
                      .parameters = root->parameters(),
                      .sharding = pipeline::fsdp_sharding(*root)});
    }
    // Counted targets: in training each microbatch's summed loss times pp_token_scale_ (which the
    // executor's loss_scale brings to dp / counted), in evaluation (no autograd) the plain sum.
    auto loss = [this](const at::Tensor& logits, const at::Tensor& targets) {
      if (!counted_targets()) return models::lm_loss(logits, targets);
      const auto sum = models::summed_lm_loss(logits, targets);
      return at::GradMode::is_enabled() ? sum * pp_token_scale_ : sum;
    };
    executor_.emplace(plan, mesh_.comm("pp"), std::move(mine), loss,
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
                                if (tracer_.active())
                                  tracer_.span(pipeline::to_string(a), "compute", begin, end);
                              },
                          // Packed conversations: each stage's model gets its microbatch's positions.
                          .before_forward =
                              [this](int stage, int microbatch) {
                                if (stage_positions_.empty()) return;
                                for (size_t i = 0; i < roots_.size(); ++i)
                                  if (stage_ids_[i] == stage)
                                    roots_[i]->inner().set_positions(stage_positions_.at(size_t(microbatch)));
                              },
                      });
  }
  full = nullptr;  // parts of other stages
  if (from_file) {
    for (auto& root : roots_) load_shards(*root.ptr(), weights, recipe_.init_from);
    const auto now = resident_now();
    log(
        fmt::format("model: weights from {}, each rank reading the rows of its shards (resident: {:.0f} MiB "
                    "of its own, {:.0f} MiB of the file's pages; peak so far {:.0f} MiB)",
                    recipe_.init_from, now.own_mib, now.file_mib, peak_rss_mib()));
  }
  if (recipe_.cpu.microbatch_threads > 1) make_thread_models();
  const int64_t per_step = recipe_.train.grad_accum * (par.pp > 1 ? par.microbatches : 1);
  for (int64_t i = 0; i < per_step; ++i) {
    inputs_.push_back(at::zeros({recipe_.micro_batch(), recipe_.data.seq_len},
                                at::TensorOptions(device_).dtype(at::kLong)));
    targets_.push_back(at::zeros_like(inputs_.back()));
    if (chat_train_ && chat_train_->packed()) positions_.push_back(at::zeros_like(inputs_.back()));
  }
  const auto f64 = at::TensorOptions(device_).dtype(at::kDouble);
  token_scale_ = at::zeros({}, f64), pp_token_scale_ = at::zeros({}, f64),
  local_targets_ = at::zeros({1}, f64);

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
  log(fmt::format(
      "model: {:.2f}M parameters ({} layers, dim {}, {} experts top-{}, {} routing); dp {} x pp {}{}{}",
      double(c.parameter_count()) / 1e6, c.layers, c.dim, c.experts, c.top_k, c.routing, par.dp, par.pp,
      par.ep > 1 ? fmt::format(", experts over ep {} ({} per rank)", par.ep, c.experts / par.ep) : "",
      par.pp > 1 ? fmt::format(", schedule {} with {} microbatches", par.schedule, par.microbatches) : ""));
  if (const int64_t every = recipe_.train.activation_checkpointing; every > 0)
    log(every == 1
            ? std::string("activation checkpointing: every block recomputes its forward in backward")
            : fmt::format(
                  "activation checkpointing: every {}-th block (layers 0, {}, ...) recomputes its forward "
                  "in backward",
                  every, every));
}

// cpu.microbatch_threads: the copies of the model that the threads past the first run. A
// copy's parameters are the sharded model's, name for name, as tensors of their own over the same
// storage (set_data): the bytes a unit's all-gather fills (Note [unshard by storage resize]) are
// the ones the copy reads, while its gradients and router statistics are its own.
void Trainer::make_thread_models() {
  const auto named = roots_.front()->inner().named_parameters();
  for (int t = 1; t < recipe_.cpu.microbatch_threads; ++t) {
    auto copy =
        models::MoETransformer(recipe_.model, models::Weights::kUnallocated);  // takes the shards' storage
    if (const int64_t every = recipe_.train.activation_checkpointing; every > 0)
      copy->wrap_blocks([every](const models::Block& block, int64_t layer) {
        return checkpoints_layer(every, layer) ? torch::nn::AnyModule(Checkpoint(torch::nn::AnyModule(block)))
                                               : torch::nn::AnyModule(block);
      });
    at::NoGradGuard g;
    const auto own = copy->named_parameters();
    if (own.size() != named.size())
      throw std::logic_error(
          fmt::format("microbatch threads: a copy of the model has {} parameters, the sharded model {}",
                      own.size(), named.size()));
    for (const auto& item : own) {
      const at::Tensor* p = named.find(item.key());
      if (!p)
        throw std::logic_error(
            fmt::format("microbatch threads: the sharded model has no parameter '{}'", item.key()));
      item.value().set_data(p->detach());
      thread_params_.emplace_back(item.value(), *p);
    }
    thread_models_.push_back(std::move(copy));
  }
  log(fmt::format("microbatch threads: {} microbatches at once, one thread each, each operator on one thread",
                  recipe_.cpu.microbatch_threads));
}

}  // namespace fsdpp::train::detail
