// Each section of a recipe, read and checked by a function of its own, and the rules that tie the
// sections together; recipe.cpp runs them in order over one JSON object.
#include <ATen/core/grad_mode.h>

#include <filesystem>
#include <optional>
#include <set>

#include "fsdpp/base/paths.hpp"
#include "fsdpp/comm/init.hpp"
#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/table.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/hf.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "recipe_reader.hpp"

namespace fsdpp::train::recipe_detail {

namespace fs = std::filesystem;

namespace {

// Whether the plan splits some backward into input and weight halves (I, W), as the zero-bubble
// schedules do.
bool splits_backward(const pipeline::Plan& plan) {
  for (const auto& rank : plan.compute)
    for (const auto& a : rank)
      if (a.type == pipeline::ActionType::kBackwardInput) return true;
  return false;
}

}  // namespace

void read_data(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader d = top.section("data");
  d.choice("source", rc.data.source,
           {DataSource::kFortunes, DataSource::kFiles, DataSource::kSynthetic, DataSource::kShards,
            DataSource::kChat});
  d.strings("paths", rc.data.paths);
  d.string("path", rc.data.path);
  d.string("tokenizer", rc.data.tokenizer);
  d.string("chat_template", rc.data.chat_template);
  d.boolean("pack", rc.data.pack);
  // A transformers directory brings its own tokenizer unless the recipe names another.
  std::error_code exists_ec;
  if (!d.find("tokenizer") && hf::is_checkpoint_dir(rc.init_from) &&
      fs::is_regular_file(fs::path(rc.init_from) / "tokenizer.json", exists_ec))
    rc.data.tokenizer = rc.init_from;
  d.integer("seq_len", rc.data.seq_len, 2, 1 << 20);
  d.number("val_fraction", rc.data.val_fraction, 0, 0.5, true);
  d.integer("synthetic_bytes", rc.data.synthetic_bytes, 1024, kBig);
  if (rc.data.seq_len > rc.model.max_seq_len)
    d.fail("seq_len", fmt::format("must be at most model.max_seq_len ({}), got {}", rc.model.max_seq_len,
                                  rc.data.seq_len));
  const bool chat = rc.data.source == DataSource::kChat;
  const bool reads_paths = rc.data.source == DataSource::kFiles || chat;
  // Conversations come from JSONL files (paths) or from `fsdpp tokenize --chat`'s shards (path).
  if (chat && rc.data.paths.empty() == rc.data.path.empty())
    d.fail(rc.data.paths.empty() ? "paths" : "path",
           "source \"chat\" reads JSONL files (paths) or the shards of `fsdpp tokenize --chat` (path): give "
           "one of the two");
  else if (reads_paths && !chat && rc.data.paths.empty())
    d.fail("paths", fmt::format("source \"{}\" needs at least one path", name_of(rc.data.source)));
  if (!reads_paths && !rc.data.paths.empty())
    d.fail("paths", fmt::format("only read with source \"files\" or \"chat\" (source is \"{}\")",
                                name_of(rc.data.source)));
  if (rc.data.source != DataSource::kChat && !rc.data.chat_template.empty())
    d.fail("chat_template",
           fmt::format("only read with source \"chat\" (source is \"{}\")", name_of(rc.data.source)));
  if (rc.data.source != DataSource::kChat && rc.data.pack)
    d.fail("pack", fmt::format("packs conversations: only read with source \"chat\" (source \"{}\" already "
                               "fills every sample with its token stream)",
                               name_of(rc.data.source)));
  if (!rc.data.chat_template.empty()) rc.data.chat_template = resolve(rc.data.chat_template, base_dir);
  if (rc.data.source == DataSource::kShards && rc.data.path.empty())
    d.fail("path", "source \"shards\" needs the directory of token shards (fsdpp tokenize writes one)");
  if (rc.data.source != DataSource::kShards && !chat && !rc.data.path.empty())
    d.fail("path", fmt::format("only read with source \"shards\" or \"chat\" (source is \"{}\")",
                               name_of(rc.data.source)));
  if (chat && !rc.data.path.empty() && !rc.data.chat_template.empty())
    d.fail("chat_template",
           "the shards of `fsdpp tokenize --chat` are rendered already (its --chat-template)");
  if (!rc.data.path.empty()) {
    rc.data.path = resolve(rc.data.path, base_dir);
    std::error_code ec;
    if (!fs::is_directory(rc.data.path, ec)) {
      d.fail("path", fmt::format("{} is not a directory", rc.data.path));
    } else {
      // Every shard's header against its size (and the index), before any rank starts.
      for (const char* split : {"train", "val"}) try {
          const ShardSet set(rc.data.path, split, rc.model.vocab_size);
          // Plain shards of conversations would train on every token, and conversations need masks.
          if (set.chat() != chat)
            d.fail("path",
                   chat ? fmt::format("{} holds token shards without conversations' masks: write them "
                                      "with `fsdpp tokenize --chat`",
                                      rc.data.path)
                        : fmt::format("{} holds conversations (`fsdpp tokenize --chat`): read them with "
                                      "data.source \"chat\", which trains on the assistant's tokens only",
                                      rc.data.path));
        } catch (const std::exception& e) {
          d.fail("path", e.what());
        }
    }
  }
  // "none": token shards made by another tool (llm.c's GPT-2 files): tokens are only checked
  // against the model's vocabulary, and nothing is decoded.
  if (rc.data.tokenizer == "none" && rc.data.source != DataSource::kShards)
    d.fail("tokenizer",
           fmt::format("\"none\" is only for source \"shards\" (source is \"{}\")", name_of(rc.data.source)));
  if (rc.data.tokenizer != "bytes" && rc.data.tokenizer != "none")
    rc.data.tokenizer = resolve(rc.data.tokenizer, base_dir);
  if (rc.data.tokenizer != "none") try {
      rc.tokenizer = Tokenizer::load(rc.data.tokenizer);
      if (!rc.tokenizer->fits_model(rc.model.vocab_size))
        d.fail("tokenizer",
               fmt::format("{} has a vocabulary of {} but model.vocab_size is {}: {}", rc.data.tokenizer,
                           rc.tokenizer->vocab_size(), rc.model.vocab_size,
                           rc.tokenizer->tokenizer_json().empty() ? "they must be equal"
                                                                  : "the model needs a row for every token"));
      const auto index = fs::path(rc.data.path) / "index.json";
      std::error_code ec;
      if (!rc.data.path.empty() && fs::is_regular_file(index, ec)) {
        const auto recorded =
            read_json_file(index.string(), "shard index").value("tokenizer", json::object());
        try {
          rc.tokenizer->check_matches(recorded, "data.path " + rc.data.path);
        } catch (const std::runtime_error& e) {
          d.fail("tokenizer",
                 fmt::format("{}: set data.tokenizer to the tokenizer the shards were made with", e.what()));
        }
      }
    } catch (const std::exception& e) {
      d.fail("tokenizer", e.what());
    }
  for (size_t i = 0; i < rc.data.paths.size(); ++i) {
    auto& p = rc.data.paths[i];
    p = resolve(p, base_dir);
    // Text files and directories of them: a FIFO would block, a device never end.
    if (const auto kind = file_kind(p); kind == "missing")
      d.fail(fmt::format("paths[{}]", i), fmt::format("{} does not exist", p));
    else if (kind != "a regular file" && kind != "a directory")
      d.fail(fmt::format("paths[{}]", i),
             fmt::format("{} is {}, not a text file or a directory of them", p, kind));
  }
}

void read_parallel(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader p = top.section("parallel");
  p.integer("dp", rc.parallel.dp, 1, 4096);
  p.integer("pp", rc.parallel.pp, 1, 1024);
  p.string("schedule", rc.parallel.schedule);
  p.integer("microbatches", rc.parallel.microbatches, 1, 1 << 16);
  const bool stages_given = p.find("stages_per_rank") != nullptr;
  p.integer("stages_per_rank", rc.parallel.stages_per_rank, 1, 64);
  // A V schedule holds two stages per rank: that is its default.
  if (!stages_given && rc.parallel.pp > 1 && !pipeline::is_table_file(rc.parallel.schedule)) {
    const auto names = pipeline::schedule_names();
    if (std::find(names.begin(), names.end(), rc.parallel.schedule) != names.end() &&
        pipeline::make_schedule(rc.parallel.schedule)->layout() == pipeline::Layout::kV)
      rc.parallel.stages_per_rank = 2;
  }
  p.integer("max_outstanding_sends", rc.parallel.max_outstanding_sends, 0, 1 << 16);
  p.boolean("keep_stages_unsharded", rc.parallel.keep_stages_unsharded);
  p.integer("max_active_stages", rc.parallel.max_active_stages, 1, 64);
  p.boolean("defer_reduce_grad_wait", rc.parallel.defer_reduce_grad_wait);
  p.boolean("defer_pp_recv", rc.parallel.defer_pp_recv);
  if (const json* l = p.find("unshard_lookahead")) {
    if (l->is_string() && (*l == "full" || *l == "auto")) {
      rc.parallel.unshard_lookahead = pipeline::UnshardLookahead::parse(l->get<std::string>());
    } else if (l->is_array() && !l->empty() && l->size() <= 4096 &&
               std::all_of(l->begin(), l->end(), [](const json& v) { return v.is_number_integer(); })) {
      rc.parallel.unshard_lookahead = {pipeline::UnshardLookahead::Policy::kPerRank, {}};
      for (const auto& v : *l)
        rc.parallel.unshard_lookahead.per_rank.push_back(
            static_cast<int>(std::clamp<int64_t>(v.get<int64_t>(), -1, 1 << 20)));
    } else {
      p.fail("unshard_lookahead",
             fmt::format("must be \"full\", \"auto\" or one integer per pipeline rank, got {}", l->dump()));
    }
  }
  p.boolean("reshard_after_forward", rc.parallel.reshard_after_forward);
  int dp_shard = 0;
  p.integer("ep", rc.parallel.ep, 1, 4096);
  p.integer("dp_replicate", rc.parallel.dp_replicate, 1, 4096);
  p.integer("dp_shard", dp_shard, 1, 4096);
  // dp_shard, when given, sets dp (so that an override of it needs no matching override of dp).
  auto& par = rc.parallel;
  if (dp_shard > 0) par.dp = par.dp_replicate * dp_shard;
  if (par.dp % par.dp_replicate != 0)
    p.fail("dp_replicate", fmt::format("must divide parallel.dp ({}), got {}", par.dp, par.dp_replicate));
}

void read_optim(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader o = top.section("optim");
  o.number("lr", rc.optim.lr, 0, 10, true);
  o.number("min_lr_ratio", rc.optim.min_lr_ratio, 0, 1);
  o.number("weight_decay", rc.optim.weight_decay, 0, 10);
  o.number("beta1", rc.optim.beta1, 0, 0.999999);
  o.number("beta2", rc.optim.beta2, 0, 0.999999);
  o.number("eps", rc.optim.eps, 0, 1, true);
  o.integer("warmup_steps", rc.optim.warmup_steps, 0, kBig);
  o.number("grad_clip", rc.optim.grad_clip, 0, 1e9);
}

void read_train(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader t = top.section("train");
  t.integer("steps", rc.train.steps, 1, kBig);
  t.integer("global_batch", rc.train.global_batch, 1, kBig);
  t.integer("grad_accum", rc.train.grad_accum, 1, 1 << 20);
  t.integer("seed", rc.train.seed, 0, kBig);
  t.choice("device", rc.train.device, {Device::kCpu, Device::kCuda});
  t.boolean("cuda_graph", rc.train.cuda_graph);
  if (const json* ac = t.find("activation_checkpointing")) {
    if (ac->is_string() && (*ac == "none" || *ac == "full")) {
      rc.train.activation_checkpointing = *ac == "full" ? 1 : 0;
    } else if (ac->is_number_integer() && *ac >= 1 && *ac <= rc.model.layers) {
      rc.train.activation_checkpointing = ac->get<int64_t>();
    } else {
      t.fail("activation_checkpointing",
             fmt::format("must be \"none\", \"full\" or k, every k-th block (1 to model.layers = {}), got {}",
                         rc.model.layers, ac->dump()));
    }
  }
  if (rc.train.device == Device::kCuda && !comm::has_backend(comm::Backend::kNccl))
    t.fail("device",
           "\"cuda\" needs fsdpp built with the NCCL backend (a CUDA build of LibTorch; this build "
           "has none)");
  if (rc.train.cuda_graph && rc.train.device != Device::kCuda)
    t.fail("cuda_graph", "needs train.device \"cuda\"");
  if (rc.train.cuda_graph && rc.model.routing != "capacity")
    t.fail("cuda_graph",
           fmt::format("needs model.routing \"capacity\" (static shapes; \"{}\" routing reads each "
                       "expert's token count on the host, which a graph cannot replay)",
                       rc.model.routing));
}

void read_eval(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader e = top.section("eval");
  e.integer("interval", rc.eval.interval, 0, kBig);
  e.integer("batches", rc.eval.batches, 1, 1 << 20);
}

void read_checkpoint(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader c = top.section("checkpoint");
  c.boolean("enabled", rc.checkpoint.enabled);
  c.integer("interval", rc.checkpoint.interval, 0, kBig);
  c.integer("keep", rc.checkpoint.keep, 1, 1 << 20);
  c.choice("storage", rc.checkpoint.storage, {CheckpointStorage::kShared, CheckpointStorage::kLocal});
}

void read_logging(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader l = top.section("logging");
  l.integer("interval", rc.logging.interval, 1, kBig);
  l.choice("metrics", rc.logging.metrics, {MetricsRanks::kRank0, MetricsRanks::kAll, MetricsRanks::kNone});
  l.boolean("plot", rc.logging.plot);
  l.string("output_dir", rc.logging.output_dir);
  if (rc.logging.output_dir.empty()) l.fail("output_dir", "must not be empty");
}

void read_dist(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader d = top.section("dist");
  d.number("watchdog_timeout_s", rc.dist.watchdog_timeout_s, 0, 1e7);
  d.boolean("check_collectives", rc.dist.check_collectives);
}

void read_cpu(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader c = top.section("cpu");
  c.integer("microbatch_threads", rc.cpu.microbatch_threads, 1, 64);
}

void check_layout(Reader& top, Recipe& rc, const std::string& base_dir, std::optional<int> world_size) {
  // Layout: the rules that tie sections together.
  const auto& par = rc.parallel;
  if (world_size && *world_size != par.dp * par.pp)
    top.fail("parallel", fmt::format("dp x pp = {} x {} = {} ranks, but the world has {}", par.dp, par.pp,
                                     par.dp * par.pp, *world_size));
  const int64_t per_step = int64_t(par.dp) * rc.train.grad_accum * (par.pp > 1 ? par.microbatches : 1);
  if (rc.train.global_batch % per_step != 0)
    top.fail("train.global_batch",
             fmt::format("must be a multiple of dp x grad_accum{} = {}, got {}",
                         par.pp > 1 ? " x parallel.microbatches" : "", per_step, rc.train.global_batch));
  if (par.pp == 1 && par.microbatches != 1)
    top.fail("parallel.microbatches", "only used with pp > 1 (use train.grad_accum to split the batch)");
  if (par.pp == 1 && par.stages_per_rank != 1) top.fail("parallel.stages_per_rank", "only used with pp > 1");
  if (par.pp > 1 && rc.model.tie_embeddings)
    top.fail("model.tie_embeddings",
             fmt::format("the embedding and the head are one parameter, which one pipeline stage holds; "
                         "pp must be 1, got {}",
                         par.pp));
  if (par.pp > 1) {
    const int stages = par.pp * par.stages_per_rank;
    if (stages > rc.model.layers)
      top.fail("parallel", fmt::format("pp x stages_per_rank = {} stages, but the model has {} layers",
                                       stages, rc.model.layers));
    try {
      pipeline::resolve_unshard_lookahead(par.unshard_lookahead, par.pp, par.max_active_stages);
    } catch (const pipeline::ScheduleError& e) {
      top.fail("parallel.unshard_lookahead", e.what());
      rc.parallel.unshard_lookahead = {};  // so that the plan below reports only its own problems
    }
    try {
      // Checked here first for messages that say more than the loaders' (a suggestion, a path).
      const auto& s = par.schedule;
      if (pipeline::is_table_file(s)) {
        rc.parallel.schedule = resolve(s, base_dir);
        try {
          require_regular_file(rc.parallel.schedule, "schedule table");
        } catch (const std::runtime_error& e) {
          throw pipeline::ScheduleError(e.what());
        }
      } else {
        const auto names = pipeline::schedule_names();
        if (std::find(names.begin(), names.end(), s) == names.end())
          throw pipeline::ScheduleError(fmt::format("unknown schedule \"{}\" (known: {}){}", s,
                                                    fmt::join(names, ", "), Reader::suggest(s, names)));
      }
      rc.plan = std::make_shared<const pipeline::Plan>(pipeline::make_plan(
          *pipeline::schedule_from(rc.parallel.schedule),
          {.pp = par.pp, .stages_per_rank = par.stages_per_rank, .microbatches = par.microbatches},
          {.fsdp_stages = true,
           .max_outstanding_sends = par.max_outstanding_sends,
           .max_active_stages = par.max_active_stages,
           .unshard_lookahead = par.unshard_lookahead,
           .defer_reduce_grad_wait = par.defer_reduce_grad_wait,
           .defer_pp_recv = par.defer_pp_recv}));
    } catch (const std::exception& e) {
      top.fail("parallel.schedule", e.what());
    }
    if (rc.plan && rc.train.activation_checkpointing > 0 && splits_backward(*rc.plan))
      top.fail("train.activation_checkpointing",
               fmt::format("schedule {} splits backward into input and weight halves (I, W), which would "
                           "recompute each checkpointed block twice and count its weight gradients twice; "
                           "use a schedule without I/W or \"none\"",
                           par.schedule));
  } else if (par.max_outstanding_sends != 0) {
    top.fail("parallel.max_outstanding_sends", "only used with pp > 1");
  }
  if (par.ep > 1) {
    if (rc.model.experts == 0)
      top.fail("parallel.ep", "expert parallelism needs MoE layers; model.experts is 0");
    else if (rc.model.experts % par.ep != 0)
      top.fail("parallel.ep",
               fmt::format("must divide model.experts ({}), got {}", rc.model.experts, par.ep));
    if (par.dp_shard() % par.ep != 0)
      top.fail("parallel.ep",
               fmt::format("must divide the shard group (parallel.dp / parallel.dp_replicate = {}), "
                           "got {}: expert-parallel ranks are data-parallel ranks",
                           par.dp_shard(), par.ep));
    if (rc.plan && splits_backward(*rc.plan))
      top.fail("parallel.ep", fmt::format("schedule {} splits backward into input and weight halves (I, W); "
                                          "expert parallelism exchanges tokens inside one whole backward: "
                                          "use a schedule without I/W",
                                          par.schedule));
  }
  if (par.pp == 1 && !par.keep_stages_unsharded)
    top.fail("parallel.keep_stages_unsharded", "only used with pp > 1");
  if (par.pp == 1 && par.max_active_stages != ParallelOptions{}.max_active_stages)
    top.fail("parallel.max_active_stages", "only used with pp > 1");
  if (par.pp == 1 && par.defer_reduce_grad_wait)
    top.fail("parallel.defer_reduce_grad_wait", "only used with pp > 1");
  if (par.pp == 1 && par.defer_pp_recv) top.fail("parallel.defer_pp_recv", "only used with pp > 1");
  if (par.pp == 1 && par.unshard_lookahead.policy != pipeline::UnshardLookahead::Policy::kFull)
    top.fail("parallel.unshard_lookahead", "only used with pp > 1");
  if (par.pp > 1 && !par.reshard_after_forward && !par.keep_stages_unsharded)
    top.fail("parallel.reshard_after_forward",
             "false keeps blocks gathered through the step, which contradicts "
             "parallel.keep_stages_unsharded: false");
  if (rc.cpu.microbatch_threads > 1) {
    const int n = rc.cpu.microbatch_threads;
    if (par.pp > 1)
      top.fail("cpu.microbatch_threads",
               "only used with pp = 1: a pipeline's microbatches follow its schedule");
    else if (rc.train.grad_accum % n != 0)
      top.fail("cpu.microbatch_threads",
               fmt::format("must divide train.grad_accum ({}), the step's microbatches, got {}",
                           rc.train.grad_accum, n));
    if (par.ep > 1)
      top.fail("cpu.microbatch_threads",
               "not with expert parallelism (parallel.ep > 1), whose token exchanges "
               "are collectives inside each microbatch's forward and backward");
    if (rc.train.device != Device::kCpu)
      top.fail(
          "cpu.microbatch_threads",
          fmt::format("runs microbatches on CPU threads; train.device is \"{}\"", name_of(rc.train.device)));
  }
  if (par.dp_replicate > 1 && rc.checkpoint.storage == CheckpointStorage::kLocal)
    top.fail("parallel.dp_replicate",
             "HSDP writes one copy of each shard, from the first replica group; with "
             "checkpoint.storage \"local\" the other nodes could not resume: use \"shared\"");
  std::error_code ec;
  if (rc.data.source == DataSource::kFortunes && !fs::is_directory(fortunes_dir(), ec))
    top.fail("data.source",
             fmt::format("the fortunes corpus is not at {} (install Debian's fortunes package: "
                         "bash scripts/setup.sh)",
                         fortunes_dir()));
}

}  // namespace fsdpp::train::recipe_detail
