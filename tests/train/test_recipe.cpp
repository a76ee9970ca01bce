// Recipe validation: every rule names the JSON path and says what is wrong; overrides; every
// bundled recipe and config is valid.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/base/files.hpp"
#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"

using namespace fsdpp;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kSource = FSDPP_SOURCE_DIR;

json base() {
  return json::parse(R"({
    "model": {"dim": 32, "layers": 2, "heads": 2, "max_seq_len": 64, "experts": 4, "top_k": 2},
    "data": {"source": "synthetic", "seq_len": 32},
    "parallel": {"dp": 2, "pp": 1},
    "train": {"steps": 10, "global_batch": 8}
  })");
}

// The problems parse_recipe reports, joined.
std::string problems(json j, const std::vector<std::string>& overrides = {},
                     std::optional<int> world = std::nullopt) {
  try {
    train::parse_recipe(std::move(j), "test.json", kSource + "/recipes", overrides, world);
  } catch (const train::RecipeError& e) {
    return e.what();
  }
  return "valid";
}

void expect(const std::string& got, const std::string& want) {
  CHECK_MESSAGE(got.find(want) != std::string::npos, "expected \"" << want << "\" in:\n" << got);
}

}  // namespace

TEST_CASE("recipe: a valid recipe parses, with defaults for what it leaves out") {
  const auto r = train::parse_recipe(base(), "dir/test.json", kSource + "/recipes");
  CHECK(r.name == "test");
  CHECK(r.model.dim == 32);
  CHECK(r.optim.lr == doctest::Approx(3e-3));
  CHECK(r.world_size() == 2);
  CHECK(r.micro_batch() == 4);
  CHECK(r.output_dir() == "runs/test");
  CHECK(r.resolved["model"]["dim"] == 32);
}

TEST_CASE("recipe: unknown keys, with a suggestion, at any depth") {
  auto j = base();
  j["optim"]["lrr"] = 1e-3;
  j["trian"] = json::object();
  j["model"]["expert"] = 4;
  j["output_dir"] = "x";
  const auto p = problems(j);
  expect(p, "output_dir: unknown key, did you mean 'logging.output_dir'?");
  expect(p, "optim.lrr: unknown key, did you mean 'lr'?");
  expect(p, "trian: unknown key, did you mean 'train'?");
  expect(p, "model.expert: unknown key, did you mean 'experts'?");
  expect(p, "4 problems");
  expect(p, "test.json");
}

TEST_CASE("recipe: wrong types and out-of-range values name the path and the rule") {
  auto j = base();
  j["train"]["steps"] = "ten";
  j["optim"]["lr"] = -1;
  j["model"]["routing"] = "drop";
  j["logging"]["plot"] = 1;
  j["data"]["val_fraction"] = 0.9;
  j["precision"]["param_dtype"] = "fp8";
  const auto p = problems(j);
  expect(p, "train.steps: must be an integer, got a string");
  expect(p, "optim.lr: must be in (0, 10], got -1");
  expect(p, "model.routing: must be one of dropless | capacity, got \"drop\", did you mean 'dropless'?");
  expect(p, "logging.plot: must be true or false, got an integer");
  expect(p, "data.val_fraction: must be in (0, 0.5], got 0.9");
  expect(p, "precision.param_dtype: must be one of float32 | bfloat16 | float16");
}

TEST_CASE("recipe: model rules") {
  auto j = base();
  j["model"]["heads"] = 3;
  j["model"]["top_k"] = 5;
  j["data"]["seq_len"] = 100;
  const auto p = problems(j);
  expect(p, "model.heads: dim 32 must split into 3 heads of even size");
  expect(p, "model.top_k: must be at most experts (4), got 5");
  expect(p, "data.seq_len: must be at most model.max_seq_len (64), got 100");
  auto m = base();
  m.erase("model");
  expect(problems(m), "model: missing");
  m["model"] = "no/such/config.json";
  expect(problems(m), "no/such/config.json");
}

TEST_CASE("recipe: layout rules (world size, batch divisibility, schedules, stages)") {
  expect(problems(base(), {}, 3), "parallel: dp x pp = 2 x 1 = 2 ranks, but the world has 3");
  CHECK(problems(base(), {}, 2) == "valid");
  expect(problems(base(), {"train.global_batch=6", "train.grad_accum=2"}),
         "train.global_batch: must be a multiple of dp x grad_accum = 4, got 6");
  expect(problems(base(), {"parallel.pp=2", "parallel.microbatches=1"}),
         "parallel.schedule: 1F1B: needs at least as many microbatches");
  expect(problems(base(), {"parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=2"}),
         "did you mean '1F1B'?");
  expect(problems(base(), {"parallel.pp=2", "parallel.stages_per_rank=2", "parallel.schedule=Interleaved1F1B",
                           "parallel.microbatches=2"}),
         "pp x stages_per_rank = 4 stages, but the model has 2 layers");
  expect(problems(base(), {"parallel.microbatches=2"}), "parallel.microbatches: only used with pp > 1");
  expect(problems(base(), {"parallel.max_outstanding_sends=2"}),
         "parallel.max_outstanding_sends: only used with pp > 1");
  expect(problems(base(), {"parallel.keep_stages_unsharded=false"}),
         "parallel.keep_stages_unsharded: only used with pp > 1");
  expect(problems(base(), {"parallel.pp=2", "parallel.microbatches=2", "train.global_batch=10"}),
         "must be a multiple of dp x grad_accum x parallel.microbatches = 4, got 10");
  CHECK(problems(base(), {"parallel.pp=2", "parallel.microbatches=2"}) == "valid");
  // A schedule given as an action table.
  CHECK(problems(base(), {"parallel.pp=2", "parallel.microbatches=4",
                          "parallel.schedule=" + kSource + "/tests/pipeline/custom_1f1b.csv"}) == "valid");
}

TEST_CASE("recipe: HSDP's dp_replicate x dp_shard") {
  auto j = base();
  j["parallel"] = {{"dp_replicate", 2}, {"dp_shard", 2}};
  auto r = train::parse_recipe(j, "test.json", kSource + "/recipes", {}, 4);
  CHECK(r.parallel.dp == 4);
  CHECK(r.parallel.dp_shard() == 2);
  CHECK(r.world_size() == 4);
  j["parallel"] = {{"dp", 4}, {"dp_replicate", 3}};
  expect(problems(j), "parallel.dp_replicate: must divide parallel.dp (4), got 3");
  j["parallel"] = {{"dp", 4}, {"dp_replicate", 2}, {"dp_shard", 4}};  // dp_shard sets dp
  CHECK(train::parse_recipe(j, "test.json", kSource + "/recipes", {}, 8).parallel.dp == 8);
  j["parallel"] = {{"dp", 4}, {"dp_replicate", 2}};
  j["checkpoint"] = {{"storage", "local"}};
  expect(problems(j), "parallel.dp_replicate: HSDP writes one copy of each shard");
}

TEST_CASE("recipe: expert parallelism's ep divides the experts and the shard group") {
  CHECK(problems(base(), {"parallel.ep=2"}) == "valid");
  CHECK(train::parse_recipe(base(), "test.json", kSource + "/recipes",
                            {"parallel.dp=8", "parallel.ep=4", "parallel.dp_replicate=2"}, 8)
            .parallel.expert_shard() == 1);
  expect(problems(base(), {"parallel.ep=3", "parallel.dp=3"}),
         "parallel.ep: must divide model.experts (4), got 3");
  expect(problems(base(), {"parallel.ep=4"}),
         "parallel.ep: must divide the shard group (parallel.dp / parallel.dp_replicate = 2), got 4");
  expect(problems(base(), {"parallel.ep=2", "parallel.dp=4", "parallel.dp_replicate=4"}),
         "parallel.dp_replicate = 1), got 2");
  expect(problems(base(), {"parallel.ep=2", "model.experts=0"}),
         "parallel.ep: expert parallelism needs MoE layers");
  expect(problems(base(), {"parallel.ep=0"}), "parallel.ep");
  expect(problems(base(), {"parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2",
                           "parallel.schedule=InterleavedZeroBubble"}),
         "parallel.ep: schedule InterleavedZeroBubble splits backward into input and weight halves");
  CHECK(problems(base(), {"parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2"}) == "valid");
}

TEST_CASE("recipe: parallel.max_active_stages and unshard_lookahead go into the plan, with pp > 1 only") {
  const auto r = train::parse_recipe(
      base(), "test.json", kSource + "/recipes",
      {"parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2", "parallel.max_active_stages=1"});
  REQUIRE(r.plan);
  for (const auto& rank : r.plan->lowered) {  // one stage per rank: the window changes nothing here
    CHECK(std::count_if(rank.begin(), rank.end(), [](const pipeline::Action& a) {
            return a.type == pipeline::ActionType::kUnshard;
          }) == 1);
  }
  const auto v2 = [&](const std::string& override) {
    return train::parse_recipe(base(), "test.json", kSource + "/recipes",
                               {"model.layers=4", "parallel.pp=2", "parallel.dp=1", "parallel.microbatches=4",
                                "parallel.stages_per_rank=2", "parallel.schedule=Interleaved1F1B", override})
        .plan->lowered;
  };
  const bool active_changes_plan = v2("parallel.max_active_stages=1") != v2("parallel.max_active_stages=2");
  CHECK(active_changes_plan);
  const bool lookahead_changes_plan =
      v2("parallel.unshard_lookahead=[1,1]") != v2("parallel.unshard_lookahead=full");
  CHECK(lookahead_changes_plan);
  const bool auto_is_its_resolution =
      v2("parallel.unshard_lookahead=auto") == v2("parallel.unshard_lookahead=[2,3]");
  CHECK(auto_is_its_resolution);
  expect(problems(base(), {"parallel.max_active_stages=2"}),
         "parallel.max_active_stages: only used with pp > 1");
  expect(problems(base(), {"parallel.unshard_lookahead=auto"}),
         "parallel.unshard_lookahead: only used with pp > 1");
  expect(problems(base(), {"parallel.defer_pp_recv=true"}), "parallel.defer_pp_recv: only used with pp > 1");
  const std::vector<std::string> pp2 = {"parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2"};
  const auto with = [&](const std::string& o) {
    auto all = pp2;
    all.push_back(o);
    return problems(base(), all);
  };
  expect(with("parallel.max_active_stages=0"), "parallel.max_active_stages: must be in [1, 64], got 0");
  expect(with("parallel.unshard_lookahead=soon"),
         "parallel.unshard_lookahead: must be \"full\", \"auto\" or one integer per pipeline rank, got "
         "\"soon\"");
  expect(with("parallel.unshard_lookahead=[1]"),
         "parallel.unshard_lookahead: unshard lookahead needs one value per pipeline rank (2), got 1");
  expect(
      with("parallel.unshard_lookahead=[1,4]"),
      "parallel.unshard_lookahead: unshard lookahead of rank 1 must be in [1, max_active_stages=3], got 4");
  // defer_pp_recv reaches the plan: deferred receives sit elsewhere than early ones (the default).
  const auto plan_of = [&](std::vector<std::string> o) {
    o.insert(o.end(), pp2.begin(), pp2.end());
    return train::parse_recipe(base(), "test.json", kSource + "/recipes", o).plan->lowered;
  };
  const bool deferred_differ = plan_of({"parallel.defer_pp_recv=true"}) != plan_of({});
  const bool early_by_default = plan_of({"parallel.defer_pp_recv=false"}) == plan_of({});
  CHECK(deferred_differ);
  CHECK(early_by_default);
}

TEST_CASE("recipe: parallel.reshard_after_forward") {
  const auto r = train::parse_recipe(base(), "test.json", kSource + "/recipes",
                                     {"parallel.reshard_after_forward=false"});
  CHECK(!r.parallel.reshard_after_forward);
  CHECK(problems(base(), {"parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2",
                          "parallel.reshard_after_forward=false"}) ==
        "valid");  // what a pipeline's plan does anyway
  expect(problems(base(), {"parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2",
                           "parallel.reshard_after_forward=false", "parallel.keep_stages_unsharded=false"}),
         "parallel.reshard_after_forward: false keeps blocks gathered through the step, which contradicts");
}

TEST_CASE("recipe: cpu.microbatch_threads divides train.grad_accum, with pp = 1, ep = 1, on the CPU") {
  CHECK(train::parse_recipe(base(), "test.json", kSource + "/recipes", {}).cpu.microbatch_threads == 1);
  const auto r = train::parse_recipe(base(), "test.json", kSource + "/recipes",
                                     {"cpu.microbatch_threads=2", "train.grad_accum=4"});
  CHECK(r.cpu.microbatch_threads == 2);
  expect(problems(base(), {"cpu.microbatch_threads=2"}),
         "cpu.microbatch_threads: must divide train.grad_accum (1), the step's microbatches, got 2");
  expect(problems(base(), {"cpu.microbatch_threads=0"}), "cpu.microbatch_threads: must be in [1, 64], got 0");
  expect(problems(base(),
                  {"cpu.microbatch_threads=2", "parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2"}),
         "cpu.microbatch_threads: only used with pp = 1: a pipeline's microbatches follow its schedule");
  expect(problems(base(), {"cpu.microbatch_threads=2", "train.grad_accum=2", "parallel.ep=2"}),
         "cpu.microbatch_threads: not with expert parallelism (parallel.ep > 1)");
  expect(problems(base(), {"cpu.microbatch_threads=2", "train.grad_accum=2", "train.device=cuda"}),
         "cpu.microbatch_threads: runs microbatches on CPU threads; train.device is \"cuda\"");
}

TEST_CASE("recipe: the cpu section has microbatch_threads only") {
  expect(problems(base(), {"cpu.threads=2"}), "cpu.threads: unknown key");
  expect(problems(base(), {"cpu.microbatch_thread=2"}),
         "cpu.microbatch_thread: unknown key, did you mean 'microbatch_threads'?");
}

TEST_CASE("recipe: checkpoint storage is shared or local") {
  CHECK(problems(base(), {"checkpoint.storage=local"}) == "valid");
  expect(problems(base(), {"checkpoint.storage=nfs"}), "checkpoint.storage: must be one of");
}

TEST_CASE("recipe: device and CUDA graph rules") {
  CHECK(problems(base(), {"train.device=cpu"}) == "valid");
  expect(problems(base(), {"train.device=tpu"}), "train.device: must be one of");
  expect(problems(base(), {"train.cuda_graph=true"}), "train.cuda_graph: needs train.device \"cuda\"");
  const auto cuda = problems(base(), {"train.device=cuda", "train.cuda_graph=true"});
  expect(cuda,
         "train.cuda_graph: needs model.routing \"capacity\" (static shapes; \"dropless\" routing reads each "
         "expert's token count on the host");
  if (!comm::has_backend(comm::Backend::kNccl))
    expect(cuda, "train.device: \"cuda\" needs fsdpp built with the NCCL backend");
  // Pipelines are captured too, with the same rule (the plan keeps sends and receives in NCCL's order).
  const auto pp = problems(base(), {"train.device=cuda", "train.cuda_graph=true", "model.routing=capacity",
                                    "parallel.pp=2", "parallel.microbatches=2"});
  if (comm::has_backend(comm::Backend::kNccl))
    CHECK(pp == "valid");
  else
    CHECK(pp.find("train.cuda_graph") == std::string::npos);
}

TEST_CASE("recipe: precision overrides") {
  auto j = base();
  j["precision"]["overrides"] = json::parse(R"([{"match": "*norm*", "param_dtype": "float32"},
                                                {"param_dtype": "bfloat16"}, {"match": "x"},
                                                {"match": "y", "grad_dtype": "bfloat"}])");
  const auto p = problems(j);
  expect(p, "precision.overrides[1].match: missing");
  expect(p, "precision.overrides[2]: needs param_dtype or grad_dtype");
  expect(p,
         "precision.overrides[3].grad_dtype: must be one of float32 | bfloat16 | float16, got \"bfloat\", "
         "did you mean 'bfloat16'?");
  j["precision"]["overrides"] = json::parse(
      R"([{"match": "*.router.gate.weight", "param_dtype": "float32", "grad_dtype": "float32"}])");
  j["precision"]["param_dtype"] = "bfloat16";
  // Every combination PyTorch 2.15 takes: a grad_dtype beside another reduce_dtype (it still sets the
  // sharded gradient's dtype), reduce_dtype unset (null) and an explicit grad_dtype of none (null).
  j["precision"]["reduce_dtype"] = "float16";
  CHECK(problems(j) == "valid");
  j["precision"]["reduce_dtype"] = nullptr;
  j["precision"]["overrides"].push_back(json::parse(R"({"match": "*norm*", "grad_dtype": null})"));
  const auto unset = train::parse_recipe(j, "t.json", ".");
  CHECK_FALSE(unset.precision.policy.reduce_dtype.has_value());
  REQUIRE(unset.precision.overrides.size() == 2);
  REQUIRE(unset.precision.overrides[1].grad_dtype);
  CHECK_FALSE(unset.precision.overrides[1].grad_dtype->dtype.has_value());
  const auto norm = unset.precision.policy.grad_dtype("layers.0.attn_norm.weight", at::Tensor());
  REQUIRE(norm);
  CHECK_FALSE(norm->dtype.has_value());
  j["precision"]["reduce_dtype"] = 16;
  expect(problems(j), "precision.reduce_dtype: must be a string, got an integer");
  j["precision"]["overrides"] = json::parse(
      R"([{"match": "*.router.gate.weight", "param_dtype": "float32", "grad_dtype": "float32"}])");
  j["precision"]["reduce_dtype"] = "float32";
  const auto r = train::parse_recipe(j, "t.json", ".");
  REQUIRE(r.precision.overrides.size() == 1);
  CHECK((r.precision.overrides[0].grad_dtype->dtype == at::kFloat));
  // The policy fully_shard gets, ready: bfloat16 except the router gates, reduced in float32.
  const auto& policy = r.precision.policy;
  CHECK((policy.param_dtype == at::kBFloat16));
  CHECK((policy.reduce_dtype == at::kFloat));
  REQUIRE(policy.param_dtype_override);
  REQUIRE(policy.grad_dtype);
  const at::Tensor any;
  CHECK((policy.param_dtype_override("layers.1.moe.router.gate.weight", any) == at::kFloat));
  CHECK_FALSE(policy.param_dtype_override("layers.1.attn.qkv.weight", any).has_value());
  CHECK((policy.grad_dtype("layers.1.moe.router.gate.weight", any)->dtype == at::kFloat));
  CHECK_FALSE(policy.grad_dtype("layers.1.attn.qkv.weight", any).has_value());
  // float32 parameters keep each parameter's own dtype (no cast), and no overrides means none.
  const auto plain = train::parse_recipe(base(), "t.json", ".");
  CHECK(!plain.precision.policy.param_dtype);
  CHECK((plain.precision.policy.reduce_dtype == at::kFloat));
  CHECK(!plain.precision.policy.param_dtype_override);
}

TEST_CASE("recipe: activation checkpointing is none, full or every k-th block") {
  const auto ac = [](const std::string& value) {
    return train::parse_recipe(base(), "t.json", kSource + "/recipes",
                               {"train.activation_checkpointing=" + value})
        .train.activation_checkpointing;
  };
  CHECK(train::parse_recipe(base(), "t.json", ".").train.activation_checkpointing == 0);
  CHECK(ac("none") == 0);
  CHECK(ac("full") == 1);
  CHECK(ac("2") == 2);
  expect(problems(base(), {"train.activation_checkpointing=some"}),
         "train.activation_checkpointing: must be \"none\", \"full\" or k, every k-th block (1 to "
         "model.layers = 2), got \"some\"");
  expect(problems(base(), {"train.activation_checkpointing=3"}), "(1 to model.layers = 2), got 3");
  expect(problems(base(), {"train.activation_checkpointing=0"}), "got 0");
  // Schedules that split backward into I and W are refused with it, naming the schedule.
  expect(problems(base(), {"train.activation_checkpointing=full", "parallel.pp=2", "parallel.microbatches=2",
                           "parallel.schedule=InterleavedZeroBubble"}),
         "train.activation_checkpointing: schedule InterleavedZeroBubble splits backward");
  CHECK(problems(base(), {"train.activation_checkpointing=full", "parallel.pp=2",
                          "parallel.microbatches=2"}) == "valid");
}

TEST_CASE(
    "recipe: the tokenizer's vocabulary is the model's; token shards need their directory and tokenizer") {
  auto j = base();
  j["data"]["tokenizer"] = "tokenizers/fortunes-bpe-2048.model";  // relative to the recipe's folder
  expect(problems(j), "data.tokenizer: " + kSource +
                          "/recipes/tokenizers/fortunes-bpe-2048.model has a vocabulary of 2048 "
                          "but model.vocab_size is 256: they must be equal");
  j["model"]["vocab_size"] = 2048;
  const auto r = train::parse_recipe(j, "test.json", kSource + "/recipes");
  REQUIRE(r.tokenizer);
  CHECK(r.tokenizer->vocab_size() == 2048);
  j["data"]["tokenizer"] = "tokenizers/missing.model";
  // Neither beside the recipe nor in the working directory: the message names the full path.
  expect(problems(j), "data.tokenizer: tokenizer " + fs::current_path().string() +
                          "/tokenizers/missing.model: no such file");
  j = base();
  j["data"]["tokenizer"] = "none";
  expect(problems(j), "data.tokenizer: \"none\" is only for source \"shards\" (source is \"synthetic\")");
  j = base();
  j["data"]["source"] = "shards";
  expect(problems(j), "data.path: source \"shards\" needs the directory of token shards");
  j["data"]["path"] = "/nonexistent/shards";
  expect(problems(j), "data.path: /nonexistent/shards is not a directory");
  // Shards made with one tokenizer are not read with another.
  const auto dir = fs::temp_directory_path() / ("fsdpp-recipe-shards-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  json shards = json::array();
  for (const std::string split : {"train", "val"}) {
    train::ShardWriter w((dir / ("t_" + split + "_000001.bin")).string(), train::kShardU16);
    const std::vector<int32_t> tokens(100, 3);
    w.append(tokens.data(), tokens.size());
    w.close();
    shards.push_back({{"file", "t_" + split + "_000001.bin"}, {"split", split}, {"tokens", 100}});
  }
  write_file_atomically(
      (dir / "index.json").string(),
      json{{"tokenizer", {{"spec", "/somewhere/tok.model"}, {"hash", "crc32c:12345678"}}}, {"shards", shards}}
          .dump());
  j["data"]["path"] = dir.string();
  expect(problems(j), "data.tokenizer: data.path " + dir.string() +
                          " was written with tokenizer /somewhere/tok.model "
                          "(crc32c:12345678), not bytes (bytes)");
  j["data"]["tokenizer"] = "none";  // nothing decoded: any shards of the right vocabulary
  CHECK(problems(j) == "valid");
  // Shards are opened, and their headers checked, when the recipe is read.
  fs::resize_file(dir / "t_val_000001.bin", 1100);
  expect(problems(j), "data.path: data: " + (dir / "t_val_000001.bin").string() +
                          ": the header (offset 8) says 100 tokens");
  fs::remove_all(dir);
}

TEST_CASE("recipe: the pipeline plan is made once, when the recipe is read") {
  CHECK(train::parse_recipe(base(), "t.json", ".").plan == nullptr);
  const auto r =
      train::parse_recipe(base(), "t.json", kSource + "/recipes",
                          {"parallel.pp=2", "parallel.microbatches=4", "parallel.max_outstanding_sends=1"});
  REQUIRE(r.plan);
  CHECK(r.plan->spec.pp == 2);
  CHECK(r.plan->spec.microbatches == 4);
  CHECK(r.plan->max_outstanding_sends == 1);
  // Lowered for sharded stages: each rank's program reduces each of its stages' gradients once.
  for (const auto& rank : r.plan->lowered)
    CHECK(std::count_if(rank.begin(), rank.end(), [](const pipeline::Action& a) {
            return a.type == pipeline::ActionType::kReduceGrad;
          }) == 1);
}

TEST_CASE("recipe: dotted overrides") {
  const auto r = train::parse_recipe(
      base(), "t.json", ".",
      {"optim.lr=1e-3", "data.source=synthetic", "checkpoint.keep=5", "name=other", "model.dim=64"});
  CHECK(r.optim.lr == doctest::Approx(1e-3));
  CHECK(r.checkpoint.keep == 5);
  CHECK(r.name == "other");
  CHECK(r.model.dim == 64);
  CHECK(r.resolved["optim"]["lr"] == 1e-3);
  expect(problems(base(), {"optim.lr"}), "override 'optim.lr': expected key=value");
  expect(problems(base(), {"train.steps.x=1"}), "override 'train.steps.x=1': train.steps is not an object");
  expect(problems(base(), {"optim..lr=1"}), "empty key component");
  expect(problems(base(), {"train.steps=abc"}), "train.steps: must be an integer, got a string");
}

TEST_CASE("recipe: every bundled recipe and config is valid") {
  int n = 0;
  for (const auto& e : fs::directory_iterator(kSource + "/recipes")) {
    if (e.path().extension() != ".json") continue;
    CAPTURE(e.path().string());
    // The fortunes recipes need the corpus; validate them against a stand-in directory.
    setenv("FSDPP_FORTUNES_DIR", kSource.c_str(), 1);
    std::vector<std::string> found;
    try {
      train::load_recipe(e.path().string());
    } catch (const train::RecipeError& ex) {
      found = ex.problems();
    }
    // A GPU recipe is valid where the build has the NCCL backend; elsewhere that is its only problem.
    if (!comm::has_backend(comm::Backend::kNccl) &&
        fsdpp::read_json_file(e.path().string()).value("train", json::object()).value("device", "") ==
            "cuda") {
      REQUIRE(found.size() == 1);
      CHECK(found[0].find("train.device: \"cuda\" needs fsdpp built with the NCCL backend") !=
            std::string::npos);
    } else {
      CHECK(found.empty());
    }
    unsetenv("FSDPP_FORTUNES_DIR");
    ++n;
  }
  CHECK(n >= 4);
  for (const auto& e : fs::directory_iterator(kSource + "/configs")) {
    CAPTURE(e.path().string());
    std::ifstream f(e.path());
    CHECK_NOTHROW(train::parse_model_config(json::parse(f), e.path().string()));
  }
}

TEST_CASE("edit distance") {
  CHECK(train::edit_distance("kitten", "sitting") == 3);
  CHECK(train::edit_distance("", "abc") == 3);
  CHECK(train::edit_distance("same", "same") == 0);
}

TEST_CASE("recipe: a corpus of malformed and hostile recipes; each is refused with its path and rule") {
  const auto dir = kSource + "/tests/train/hostile_recipes";
  std::ifstream f(dir + "/expected.json");
  const auto expected = json::parse(f);
  REQUIRE(expected.size() >= 40);
  for (const auto& [file, want] : expected.items()) {
    CAPTURE(file);
    std::string got = "accepted";
    try {
      train::load_recipe(dir + "/" + file);
    } catch (const train::RecipeError& e) {
      got = e.what();
    }
    expect(got, want.get<std::string>());
    // Every message names the file it is about.
    CHECK(got.find(file.substr(0, file.size() - 5)) != std::string::npos);
  }
}

TEST_CASE("recipe: a refused value is named once, as given, not the default it left in place") {
  const auto got = problems(base(), {"data.seq_len=0"});
  expect(got, "1 problem");
  expect(got, "data.seq_len: must be in [2, 1048576], got 0");
  CHECK(got.find("max_seq_len") == std::string::npos);
}

TEST_CASE("recipe: a key given twice in a recipe file is refused, naming its path") {
  const auto dir = fs::temp_directory_path() / ("fsdpp-dup-" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "top.json")
      << R"({"model": {"dim": 32, "layers": 2, "heads": 2, "max_seq_len": 64}, "data": {"source": "synthetic"},)"
      << R"( "train": {"steps": 3, "global_batch": 8}, "train": {"steps": 5}})";
  std::ofstream(dir / "nested.json")
      << R"({"model": {"dim": 32, "layers": 2, "heads": 2, "max_seq_len": 64, "dim": 64},)"
      << R"( "data": {"source": "synthetic"}, "precision": {"overrides": [{"match": "a"},)"
      << R"( {"match": "b", "param_dtype": "float32", "param_dtype": "bfloat16"}]}})";
  for (const auto& [file, path] :
       {std::pair<std::string, std::string>{"top.json", "train:"}, {"nested.json", "model.dim:"}}) {
    CAPTURE(file);
    std::string got = "accepted";
    try {
      train::load_recipe((dir / file).string());
    } catch (const train::RecipeError& e) {
      got = e.what();
    }
    expect(got, path + " given twice in this recipe file");
  }
  fs::remove_all(dir);
}

TEST_CASE("recipe: data.paths must be text files or directories: a device or a FIFO is refused, naming it") {
  const auto fifo = fs::temp_directory_path() / ("fsdpp-fifo-" + std::to_string(getpid()));
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  auto j = base();
  j["data"] = {{"source", "files"}, {"paths", {"/dev/zero", fifo.string(), kSource + "/README.md"}}};
  const auto got = problems(j);
  expect(got, "data.paths[0]: /dev/zero is a character device, not a text file or a directory of them");
  expect(got, "data.paths[1]: " + fifo.string() + " is a FIFO");
  CHECK(got.find("paths[2]") == std::string::npos);
  // A FIFO inside a directory of text: named, not read (reading it would block).
  const auto dir = fs::temp_directory_path() / ("fsdpp-fifo-dir-" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "a.txt") << "text\n";
  REQUIRE(mkfifo((dir / "b.txt").c_str(), 0600) == 0);
  std::string error;
  try {
    train::list_text_files(dir.string());
  } catch (const std::exception& e) {
    error = e.what();
  }
  expect(error, (dir / "b.txt").string() + " is a FIFO, not a text file");
  fs::remove(fifo);
  fs::remove_all(dir);
}

TEST_CASE("recipe: a V schedule defaults to 2 stages per rank; others to 1") {
  auto j = base();
  j["model"]["layers"] = 4;
  j["parallel"] = {{"dp", 1}, {"pp", 2}, {"microbatches", 4}, {"schedule", "ZBVZeroBubble"}};
  const auto v = train::parse_recipe(j, "test.json", kSource + "/recipes");
  CHECK(v.parallel.stages_per_rank == 2);
  j["parallel"]["schedule"] = "1F1B";
  CHECK(train::parse_recipe(j, "test.json", kSource + "/recipes").parallel.stages_per_rank == 1);
  j["parallel"]["schedule"] = "DualPipeV";
  j["parallel"]["stages_per_rank"] = 1;  // given: kept, and refused by the schedule
  expect(problems(j), "DualPipeV: exactly 2 stages per rank");
}

TEST_CASE("recipe: precision.overrides patterns that match no parameter are listed") {
  auto j = base();
  j["precision"] = {{"param_dtype", "bfloat16"},
                    {"overrides",
                     {{{"match", "*.router.gate.weight"}, {"param_dtype", "float32"}},
                      {{"match", "*.gate_proj.*"}, {"param_dtype", "float32"}},
                      {{"match", "*norm*"}, {"param_dtype", "float32"}}}}};
  const auto r = train::parse_recipe(j, "test.json", kSource + "/recipes");
  CHECK(train::unmatched_overrides(r) ==
        std::vector<std::string>{"precision.overrides[1].match \"*.gate_proj.*\""});
}
