// `fsdpp run` end to end, as a user runs it: real processes under the launcher, real files.
// Resume is bitwise exact; dp, pp and 2D layouts train to the same losses; checkpoints load at
// another layout and consolidate into one safetensors file that an independent reader accepts.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <thread>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "fsdpp/fsdp/checkpoint.hpp"
#include "fsdpp/base/mkl_dispatch.hpp"
#include "fsdpp/base/openmp_wait.hpp"
#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/train/checkpoints.hpp"
#include "fsdpp/train/generate.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "fsdpp/train/trainer.hpp"
#include "train/run_helpers.hpp"

using namespace fsdpp;
using namespace fsdpp::test;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Two runs of 10 steps at different layouts that must train alike: losses and gradient norms
// within `tolerance` at every step.
void check_trains_alike(const std::string& a_dir, const std::string& b_dir, double tolerance) {
  const auto a = losses(a_dir), b = losses(b_dir);
  const auto na = metric_by_step(a_dir, "grad_norm"), nb = metric_by_step(b_dir, "grad_norm");
  REQUIRE(a.size() == 10);
  REQUIRE(b.size() == 10);
  for (const auto& [step, loss] : a) {
    CAPTURE(step);
    CHECK(b.at(step) == doctest::Approx(loss).epsilon(tolerance));
    CHECK(nb.at(step) == doctest::Approx(na.at(step)).epsilon(tolerance));
  }
}

std::string checkpoint(const std::string& dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08lld", static_cast<long long>(step));
  return (fs::path(dir) / "checkpoints" / name).string();
}

// The two checkpoints hold bitwise equal parameters, under the same names.
void check_same_parameters(const std::string& a, const std::string& b) {
  const auto pa = fsdp::read_full_parameters(a), pb = fsdp::read_full_parameters(b);
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].first);
    CHECK(pa[i].first == pb[i].first);
    CHECK(pa[i].second.equal(pb[i].second));
  }
}

// The two checkpoints hold the same parameters within float tolerance (allclose 1e-4), name for
// name, in whatever order their files list them.
void check_close_parameters(const std::string& a, const std::string& b) {
  const auto want = fsdp::read_full_parameters(a), got = fsdp::read_full_parameters(b);
  const std::map<std::string, at::Tensor> by_name(got.begin(), got.end());
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    CAPTURE(name);
    REQUIRE(by_name.count(name));
    CHECK(at::allclose(by_name.at(name), t, 1e-4, 1e-6));
  }
}

// Per rank-0 step of a traced run in `dir`: how many fully_shard collectives of `kind` (all_gather,
// reduce_scatter) each unit issued.
std::map<std::string, int> collectives_per_step(const std::string& dir, const std::string& kind) {
  const auto trace = json::parse(std::ifstream(dir + "/trace.json"));
  std::map<std::string, int> count;
  int steps = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X" || e["pid"] != 0) continue;
    const std::string name = e["name"];
    if (name.rfind("step ", 0) == 0) ++steps;
    const std::string prefix = kind + " fsdp " + kind + " ";  // the operation, then its label
    if (name.rfind(prefix, 0) == 0) ++count[name.substr(prefix.size())];
  }
  REQUIRE(steps > 0);
  for (auto& [unit, n] : count) {
    CHECK(n % steps == 0);
    n /= steps;
  }
  return count;
}

// A traced run with cpu.microbatch_threads = n in `dir`: every rank's span of the threads'
// forward and backward has one span for each thread on a track of its own, starting with it and
// ending within it.
void check_thread_spans(const std::string& dir, int n) {
  const auto trace = json::parse(std::ifstream(dir + "/trace.json"));
  std::map<std::pair<int, std::string>, int> tracks;  // (rank, track name) -> tid
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name")
      tracks[{e["pid"].get<int>(), e["args"]["name"].get<std::string>()}] = e["tid"];
  std::map<int, std::vector<json>> whole;                            // by rank
  std::map<std::pair<int, int>, std::map<int64_t, json>> by_thread;  // (rank, thread) -> start -> span
  const std::string all = fmt::format("forward and backward, {} threads", n);
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const int rank = e["pid"];
    if (e["name"] == all) whole[rank].push_back(e);
    for (int t = 0; t < n; ++t)
      if (e["name"] == fmt::format("forward and backward, thread {}", t)) {
        const auto track = tracks.find({rank, fmt::format("microbatch thread {}", t)});
        REQUIRE(track != tracks.end());
        CHECK(e["tid"] == track->second);
        by_thread[{rank, t}][e["ts"].get<int64_t>()] = e;
      }
  }
  REQUIRE_FALSE(whole.empty());
  for (const auto& [rank, spans] : whole)
    for (const auto& span : spans) {
      const int64_t ts = span["ts"], end = ts + span["dur"].get<int64_t>();
      for (int t = 0; t < n; ++t) {
        INFO("rank ", rank, ", thread ", t, ", span at ", ts);
        const auto& mine = by_thread[{rank, t}];
        const auto it = mine.find(ts);
        REQUIRE(it != mine.end());
        CHECK(ts + it->second["dur"].get<int64_t>() <= end);
      }
    }
  for (const auto& [key, spans] : by_thread) CHECK(spans.size() == whole[key.first].size());
}

}  // namespace

TEST_CASE("run: an invalid recipe fails before any rank starts, naming the problem") {
  const auto dir = fresh_dir("invalid");
  const auto r = sh(kBin + " run " + kRecipe + " logging.output_dir=" + dir + " optim.lrr=1 parallel.dp=0");
  CHECK(r.rc == 2);
  CHECK(r.out.find("optim.lrr: unknown key, did you mean 'lr'?") != std::string::npos);
  CHECK(r.out.find("parallel.dp: must be in [1, 4096], got 0") != std::string::npos);
  CHECK(r.out.find("[rank") == std::string::npos);
  CHECK_FALSE(fs::exists(dir));
  const auto v = sh(kBin + " validate " + kRecipe + " --nproc 3");
  CHECK(v.rc == 2);
  CHECK(v.out.find("but the world has 3") != std::string::npos);
  CHECK(sh(kBin + " validate " + kRecipe).rc == 0);
  // The layout, with HSDP and expert parallelism spelled out.
  const auto ep = sh(kBin + " validate " + std::string(FSDPP_SOURCE_DIR) +
                     "/recipes/moe-small-ep.json parallel.dp=8 parallel.dp_replicate=2");
  INFO(ep.out);
  CHECK(ep.out.find("dp 8 (2 replicas x 4 shards; ep 2: 4 of 8 experts per rank, sharded over 2 ranks) x pp "
                    "1 = 8 ranks") != std::string::npos);
  const auto bad =
      sh(kBin + " validate " + std::string(FSDPP_SOURCE_DIR) + "/recipes/moe-small-ep.json parallel.ep=3");
  CHECK(bad.rc == 2);
  CHECK(bad.out.find("parallel.ep: must divide model.experts (8), got 3") != std::string::npos);
}

TEST_CASE("run: resume continues bitwise identically to an uninterrupted run") {
  const auto whole = fresh_dir("whole"), split = fresh_dir("split");
  const std::string args =
      "train.steps=12 checkpoint.interval=4 logging.interval=1 parallel.dp=2 train.grad_accum=2";
  train_run(whole, args);
  const auto first = train_run(split, args + " --stop-after 6");
  CHECK(first.find("steps 1..6 of 12") != std::string::npos);
  // A second start without --resume refuses rather than overwrite.
  const auto again = sh(kBin + " run " + kRecipe + " logging.output_dir=" + split + " " + args);
  CHECK(again.rc != 0);
  CHECK(again.out.find("--resume") != std::string::npos);
  const auto resumed = train_run(split, args + " --resume");
  CHECK(resumed.find("resumed from") != std::string::npos);
  CHECK(resumed.find("steps 7..12 of 12") != std::string::npos);
  const auto a = losses(whole), b = losses(split);
  REQUIRE(a.size() == 12);
  REQUIRE(b.size() == 12);
  for (const auto& [step, loss] : a) {
    CAPTURE(step);
    CHECK(b.at(step) == loss);  // exact
  }
  const auto pa = fsdp::read_full_parameters(checkpoint(whole, 12));
  const auto pb = fsdp::read_full_parameters(checkpoint(split, 12));
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].first);
    CHECK(pa[i].first == pb[i].first);
    CHECK(pa[i].second.equal(pb[i].second));
  }
  // The optimizer state came back too: the resumed run's files hold it, equal to the whole run's.
  const auto sa = read_safetensors(checkpoint(whole, 12) + "/rank1.safetensors");
  const auto sb = read_safetensors(checkpoint(split, 12) + "/rank1.safetensors");
  CHECK(sa.find("head.weight.exp_avg_sq")->equal(*sb.find("head.weight.exp_avg_sq")));
  // keep = 2: older checkpoints are pruned.
  CHECK_FALSE(fs::exists(checkpoint(whole, 4)));
  CHECK(fs::exists(checkpoint(whole, 8)));
  fs::remove_all(whole);
  fs::remove_all(split);
}

TEST_CASE("run: dp, pp (1F1B) and dp x pp train to the same losses on the same data") {
  const std::string common =
      "train.steps=20 train.global_batch=8 logging.interval=1 eval.interval=0 optim.lr=3e-3";
  const auto dp = fresh_dir("dp"), pp = fresh_dir("pp"), twod = fresh_dir("2d");
  train_run(dp, common + " parallel.dp=2 train.grad_accum=2");
  train_run(pp,
            common + " parallel.dp=1 parallel.pp=2 parallel.microbatches=4 parallel.max_outstanding_sends=1");
  train_run(twod, common + " parallel.dp=2 parallel.pp=2 parallel.microbatches=2");
  const auto a = losses(dp), b = losses(pp), c = losses(twod);
  REQUIRE(a.size() == 20);
  REQUIRE(b.size() == 20);
  REQUIRE(c.size() == 20);
  for (const auto& [step, loss] : a) {
    CAPTURE(step);
    CHECK(b.at(step) == doctest::Approx(loss).epsilon(2e-4));
    CHECK(c.at(step) == doctest::Approx(loss).epsilon(2e-4));
  }
  CHECK(a.at(20) < a.at(1) - 0.5);  // and it learned something
  // The final evaluation reads eval.batches microbatches per dp rank, so dp 2 and dp 2 x pp 2 read
  // the same ones; pipelined, they go through the executor's forward-only mode two at a time.
  const auto val = [](const std::string& d) {
    return json::parse(std::ifstream(d + "/summary.json")).at("val_loss").get<double>();
  };
  CHECK(val(twod) == doctest::Approx(val(dp)).epsilon(2e-4));
  for (const auto& d : {dp, pp, twod}) fs::remove_all(d);
}

TEST_CASE(
    "run: HSDP (dp_replicate 2 x dp_shard 2) trains as plain FSDP over 4 ranks, alone and under pp 2; one "
    "copy of its checkpoint, which resumes at another layout") {
  const std::string common =
      "train.steps=10 train.global_batch=8 logging.interval=1 eval.interval=0 optim.lr=3e-3 "
      "checkpoint.interval=5";
  const auto fsdp4 = fresh_dir("fsdp4"), hsdp = fresh_dir("hsdp"), pp_fsdp = fresh_dir("pp-fsdp"),
             pp_hsdp = fresh_dir("pp-hsdp"), relayout = fresh_dir("hsdp-relayout");
  train_run(fsdp4, common + " parallel.dp=4");
  train_run(hsdp, common + " parallel.dp_replicate=2 parallel.dp_shard=2");
  check_trains_alike(fsdp4, hsdp, 2e-4);  // the gradient norms too: replicas are not counted twice
  const auto a = losses(fsdp4), b = losses(hsdp);
  // One copy: the first replica group's two ranks wrote the files; the parameters are plain FSDP's.
  CHECK(fs::exists(checkpoint(hsdp, 10) + "/rank1.json"));
  CHECK_FALSE(fs::exists(checkpoint(hsdp, 10) + "/rank2.json"));
  CHECK(sh(kBin + " ckpt verify " + checkpoint(hsdp, 10)).rc == 0);
  check_close_parameters(checkpoint(fsdp4, 10), checkpoint(hsdp, 10));
  // The HSDP checkpoint of step 5 resumes as plain FSDP over 2 ranks (grad_accum keeps the batch).
  train_run(relayout, common + " parallel.dp_replicate=2 parallel.dp_shard=2 --stop-after 5");
  train_run(relayout, common + " parallel.dp=2 train.grad_accum=2 --resume");
  CHECK(losses(relayout).at(6) == doctest::Approx(b.at(6)).epsilon(2e-4));
  // Under a 2-stage pipeline: each stage's 2 dp ranks as 2 replicas of 1 shard.
  const std::string pp = " parallel.pp=2 parallel.microbatches=2";
  train_run(pp_fsdp, common + pp + " parallel.dp=2");
  train_run(pp_hsdp, common + pp + " parallel.dp=2 parallel.dp_replicate=2");
  const auto c = losses(pp_fsdp), d = losses(pp_hsdp);
  for (const auto& [step, loss] : c) {
    CAPTURE(step);
    CHECK(d.at(step) == doctest::Approx(loss).epsilon(2e-4));
    CHECK(loss == doctest::Approx(a.at(step)).epsilon(2e-4));
  }
  for (const auto& dir : {fsdp4, hsdp, pp_fsdp, pp_hsdp, relayout}) fs::remove_all(dir);
}

TEST_CASE(
    "run: expert parallelism (ep 2 and 4, dropless and capacity) trains as ep 1, also with HSDP, under pp "
    "and "
    "with activation checkpointing; its checkpoints resume bitwise and at ep 1") {
  const std::string common =
      "train.steps=10 train.global_batch=8 logging.interval=1 eval.interval=0 optim.lr=3e-3 "
      "checkpoint.interval=5 model.experts=8 parallel.dp=4";
  std::string ep2_dropless;
  std::vector<std::string> dirs;
  for (const std::string routing : {"dropless", "capacity"}) {
    CAPTURE(routing);
    const std::string recipe = common + " model.routing=" + routing;
    const auto ref = fresh_dir("ep1-" + routing), ep2 = fresh_dir("ep2-" + routing),
               ep4 = fresh_dir("ep4-" + routing);
    dirs.insert(dirs.end(), {ref, ep2, ep4});
    train_run(ref, recipe);
    const auto out = train_run(ep2, recipe + " parallel.ep=2");
    CHECK(out.find("experts over ep 2 (4 per rank)") != std::string::npos);
    train_run(ep4, recipe + " parallel.ep=4");
    check_trains_alike(ref, ep2, 2e-4);
    check_trains_alike(ref, ep4, 2e-4);
    // The checkpoints hold whole expert tensors, [8, ...], whatever ep wrote them.
    check_close_parameters(checkpoint(ref, 10), checkpoint(ep2, 10));
    check_close_parameters(checkpoint(ref, 10), checkpoint(ep4, 10));
    // Parameter memory per rank: the shards are the same 1/4; a gathered MoE block holds 8, 4, 2 experts.
    auto memory = [](const std::string& dir) {
      return json::parse(std::ifstream(dir + "/summary.json"))["parameter_mib"];
    };
    const auto m1 = memory(ref), m2 = memory(ep2), m4 = memory(ep4);
    CHECK(m2["sharded"].get<double>() == doctest::Approx(m1["sharded"].get<double>()));
    CHECK(m4["sharded"].get<double>() == doctest::Approx(m1["sharded"].get<double>()));
    CHECK(m2["moe_block_gathered"].get<double>() < m1["moe_block_gathered"].get<double>());
    CHECK(m4["moe_block_gathered"].get<double>() < m2["moe_block_gathered"].get<double>());
    if (routing == "dropless") ep2_dropless = ep2;
  }
  // With HSDP (2 replicas of 2-rank shard groups, ep 2 inside each), under a 2-stage pipeline, and
  // with every block recomputed in backward (the recompute exchanges again).
  const auto hsdp = fresh_dir("ep-hsdp"), pp = fresh_dir("ep-pp"), ac = fresh_dir("ep-ac");
  dirs.insert(dirs.end(), {hsdp, pp, ac});
  train_run(ac, common + " parallel.ep=2 train.activation_checkpointing=full");
  check_trains_alike(ep2_dropless, ac, 1e-5);
  train_run(hsdp, common + " parallel.dp_replicate=2 parallel.dp_shard=2 parallel.ep=2");
  check_trains_alike(ep2_dropless, hsdp, 2e-4);
  train_run(pp, common + " parallel.dp=2 parallel.pp=2 parallel.microbatches=2 parallel.ep=2");
  check_trains_alike(ep2_dropless, pp, 2e-4);
  // Stopped at step 5 and resumed: at ep 2 bitwise, at ep 1 within float tolerance.
  const auto again = fresh_dir("ep-resume"), relayout = fresh_dir("ep-relayout");
  dirs.insert(dirs.end(), {again, relayout});
  for (const auto& dir : {again, relayout}) train_run(dir, common + " parallel.ep=2 --stop-after 5");
  train_run(again, common + " parallel.ep=2 --resume");
  train_run(relayout, common + " --resume");
  const auto full = losses(ep2_dropless), resumed = losses(again);
  for (int64_t step = 6; step <= 10; ++step) {
    CAPTURE(step);
    CHECK(resumed.at(step) == full.at(step));
    CHECK(losses(relayout).at(step) == doctest::Approx(full.at(step)).epsilon(2e-4));
  }
  for (const auto& dir : dirs) fs::remove_all(dir);
}

TEST_CASE(
    "run: parallel.reshard_after_forward=false gathers each block once per step, not 4 times, and trains "
    "bitwise alike; the MKL decision is logged") {
  const std::string common =
      "train.steps=10 logging.interval=1 eval.interval=0 parallel.dp=2 train.grad_accum=2 --trace";
  const auto freed = fresh_dir("reshard-true"), kept = fresh_dir("reshard-false");
  train_run(freed, common);
  const auto out = train_run(kept, common + " parallel.reshard_after_forward=false");
  const auto a = collectives_per_step(freed, "all_gather"), b = collectives_per_step(kept, "all_gather");
  CHECK(a == std::map<std::string, int>{{"layers.0", 4}, {"layers.1", 4}, {"root", 2}});
  CHECK(b == std::map<std::string, int>{{"layers.0", 1}, {"layers.1", 1}, {"root", 1}});
  CHECK(losses(kept) == losses(freed));
  check_same_parameters(checkpoint(freed, 10), checkpoint(kept, 10));
  // The command line links libfsdpp_mkl_kernels.so (Note [MKL's kernels on other vendors' CPUs]):
  // kernels by instruction set on another vendor's AVX-512 CPU, MKL's own choice elsewhere.
  __builtin_cpu_init();
  const bool other_vendor_avx512 = !__builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f") &&
                                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                                   __builtin_cpu_supports("avx512vl");
  const bool asked =
      out.find("MKL: MKL's kernels chosen by instruction set, AVX-512 on this CPU") != std::string::npos;
  const bool own = out.find("MKL: MKL's own choice") != std::string::npos;
  CHECK(asked == other_vendor_avx512);
  CHECK(own == !other_vendor_avx512);
  for (const auto& d : {freed, kept}) fs::remove_all(d);
}

TEST_CASE(
    "run: cpu.microbatch_threads=2 trains as one microbatch after the other, at dp 1 (also with "
    "activation checkpointing, and in bfloat16), at dp 2 and under HSDP, gathering and reducing each block "
    "once per step; resume is bitwise") {
  const std::string common = "train.steps=10 logging.interval=1 eval.interval=0";
  const std::map<std::string, int> once{{"layers.0", 1}, {"layers.1", 1}, {"root", 1}};
  // Each layout with a rank's microbatches a step (train.grad_accum).
  const std::vector<std::pair<std::string, int>> layouts{
      {"parallel.dp=1", 2},
      {"parallel.dp=1 train.activation_checkpointing=full", 4},
      {"parallel.dp=1 precision.param_dtype=bfloat16", 2},
      {"parallel.dp=2", 4},
      {"parallel.dp=4 parallel.dp_replicate=2", 2}};
  for (const auto& [parallel, accum] : layouts) {
    const std::string layout = parallel + " train.grad_accum=" + std::to_string(accum);
    CAPTURE(layout);
    const auto one = fresh_dir("mb-threads-1"), two = fresh_dir("mb-threads-2");
    // The reference runs every operator on one thread, as each microbatch thread does: a product
    // split over two threads may round otherwise (MKL's AVX2 kernels split some), and AdamW turns
    // a rounding in a gradient that nearly cancels into a difference of the learning rate's order.
    train_run(one, common + " " + layout, "OMP_NUM_THREADS=1 ");
    const auto out = train_run(two, common + " " + layout + " cpu.microbatch_threads=2 --trace");
    CHECK(out.find("microbatch threads: 2 microbatches at once, one thread each") != std::string::npos);
    check_trains_alike(one, two, 1e-5);
    // With 2 microbatches a step, each thread runs one, and the threads add the same gradients in the
    // same order as one microbatch after the other; with 4, each thread first sums its own two, and
    // the rounding differs.
    if (accum == 2)
      check_same_parameters(checkpoint(one, 10), checkpoint(two, 10));
    else
      check_close_parameters(checkpoint(one, 10), checkpoint(two, 10));
    CHECK(collectives_per_step(two, "all_gather") == once);
    CHECK(collectives_per_step(two, "reduce_scatter") == once);
    check_thread_spans(two, 2);
    for (const auto& d : {one, two}) fs::remove_all(d);
  }
  // Resumed from a checkpoint, the run continues bitwise as if uninterrupted.
  {
    const std::string args =
        common + " parallel.dp=1 train.grad_accum=2 cpu.microbatch_threads=2 checkpoint.interval=5";
    const auto whole = fresh_dir("mb-threads-whole"), split = fresh_dir("mb-threads-split");
    train_run(whole, args);
    train_run(split, args + " --stop-after 5");
    const auto out = train_run(split, args + " --resume");
    CHECK(out.find("resumed from") != std::string::npos);
    CHECK(losses(split) == losses(whole));
    check_same_parameters(checkpoint(whole, 10), checkpoint(split, 10));
    for (const auto& d : {whole, split}) fs::remove_all(d);
  }
}

TEST_CASE("run: activation checkpointing trains as without it, at dp 2 and at pp 2") {
  const std::string common = "train.steps=8 train.global_batch=8 logging.interval=1 eval.interval=0";
  for (const std::string layout : {"parallel.dp=2", "parallel.pp=2 parallel.microbatches=4"}) {
    CAPTURE(layout);
    const auto plain = fresh_dir("ac-none"), every = fresh_dir("ac-full"), some = fresh_dir("ac-2");
    train_run(plain, common + " " + layout);
    const auto out = train_run(every, common + " " + layout + " train.activation_checkpointing=full");
    CHECK(out.find("activation checkpointing: every block recomputes") != std::string::npos);
    train_run(some, common + " " + layout + " train.activation_checkpointing=2");
    const auto a = losses(plain), b = losses(every), c = losses(some);
    REQUIRE(a.size() == 8);
    REQUIRE(b.size() == 8);
    REQUIRE(c.size() == 8);
    for (const auto& [step, loss] : a) {
      CAPTURE(step);
      CHECK(b.at(step) == doctest::Approx(loss).epsilon(1e-5));
      CHECK(c.at(step) == doctest::Approx(loss).epsilon(1e-5));
    }
    for (const auto& d : {plain, every, some}) fs::remove_all(d);
  }
}

TEST_CASE("run: a checkpoint loads at another layout; consolidate writes full named parameters") {
  const auto dir = fresh_dir("relayout");
  const std::string args = "train.steps=10 logging.interval=1 eval.interval=0";
  train_run(dir, args + " parallel.dp=2 --stop-after 5");
  // Resume the dp=2 checkpoint as a 2-stage pipeline: the first resumed step starts from the same
  // weights, so its loss matches the uninterrupted dp=2 run's within float tolerance.
  const auto ref = fresh_dir("relayout-ref");
  train_run(ref, args + " parallel.dp=2");
  train_run(dir, args + " parallel.dp=1 parallel.pp=2 parallel.microbatches=2 --resume");
  CHECK(losses(dir).at(6) == doctest::Approx(losses(ref).at(6)).epsilon(2e-4));

  const auto file = dir + "/model.safetensors";
  const auto r = sh(kBin + " ckpt consolidate " + dir + " -o " + file);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const auto full = read_safetensors(file);
  const auto want = fsdp::read_full_parameters(checkpoint(dir, 10));
  CHECK(full.tensors.size() == want.size());
  for (const auto& [name, t] : want) {
    CAPTURE(name);
    REQUIRE(full.find(name));
    CHECK(full.find(name)->equal(t));
  }
  CHECK(full.find("layers.0.moe.router.gate.weight"));
  CHECK(full.find("layers.1.moe.experts.w1")->sizes() == at::IntArrayRef({4, 32, 32}));
  // The unsharded model built from the file has exactly these parameters.
  auto model = train::load_model(file);
  CHECK(model->named_parameters().size() == want.size());
  CHECK(model->named_parameters()["head.weight"].equal(*full.find("head.weight")));
  // An independent reader (Python's standard library only) agrees on names, shapes and values.
  const auto py = sh("python3 " + std::string(FSDPP_SOURCE_DIR) + "/tests/train/read_safetensors.py " + file);
  INFO(py.out);
  REQUIRE(py.rc == 0);
  std::istringstream lines(py.out);
  int checked = 0;
  for (std::string name, dtype; lines >> name >> dtype;) {
    double sum;
    lines >> sum;
    CAPTURE(name);
    REQUIRE(full.find(name));
    CHECK(sum == doctest::Approx(full.find(name)->to(at::kDouble).sum().item<double>()).epsilon(1e-9));
    ++checked;
  }
  CHECK(checked == int(want.size()));
  // And generation runs from it, deterministically for a seed.
  const auto g1 = sh(kBin + " generate " + file + " --prompt 'The ' --bytes 40 --seed 3");
  const auto g2 = sh(kBin + " generate " + dir + " --prompt 'The ' --bytes 40 --seed 3");
  CHECK(g1.rc == 0);
  CHECK(g1.out == g2.out);
  CHECK(g1.out.rfind("The ", 0) == 0);
  CHECK(g1.out.size() >= 44);
  fs::remove_all(dir);
  fs::remove_all(ref);
}

TEST_CASE(
    "run: token shards from `fsdpp tokenize` train to the same losses at dp 1, 2 and 4, resume bitwise, and "
    "generate through the run's tokenizer") {
  const auto dir = fresh_dir("shards");
  const auto text = dir + "/text", shards = dir + "/shards";
  fs::create_directories(text);
  int copied = 0;
  for (const auto& e : fs::directory_iterator(train::fortunes_dir()))
    if (e.is_regular_file() && !e.is_symlink() && !e.path().has_extension() && copied < 8)
      fs::copy_file(e.path(), fs::path(text) / e.path().filename()), ++copied;
  const std::string bundled = std::string(FSDPP_SOURCE_DIR) + "/recipes/tokenizers/fortunes-bpe-2048.model";
  const auto t = sh(kBin + " tokenize --tokenizer " + bundled + " " + text + " -o " + shards +
                    " --shard-tokens 20000 --val-fraction 0.25");
  INFO(t.out);
  REQUIRE(t.rc == 0);
  CHECK(t.out.find("MB/s") != std::string::npos);
  CHECK(fs::exists(shards + "/index.json"));

  const std::string common = "data.source=shards data.path=" + shards + " data.tokenizer=" + bundled +
                             " model.vocab_size=2048 train.steps=16 train.global_batch=8 logging.interval=1 "
                             "eval.interval=8 eval.batches=1 checkpoint.interval=8 optim.lr=3e-3";
  const auto d1 = dir + "/dp1", d2 = dir + "/dp2", d4 = dir + "/dp4", split = dir + "/split";
  train_run(d1, common + " parallel.dp=1 train.grad_accum=2");
  const auto out2 = train_run(d2, common + " parallel.dp=2");
  train_run(d4, common + " parallel.dp=4");
  CHECK(out2.find("bits/byte") != std::string::npos);
  const auto a = losses(d1), b = losses(d2), c = losses(d4);
  REQUIRE(a.size() == 16);
  for (const auto& [step, loss] : a) {
    CAPTURE(step);
    CHECK(b.at(step) == doctest::Approx(loss).epsilon(2e-4));
    CHECK(c.at(step) == doctest::Approx(loss).epsilon(2e-4));
  }
  CHECK(a.at(16) < a.at(1) - 0.25);
  const auto summary = json::parse(std::ifstream(d2 + "/summary.json"));
  // Bits per byte: nats per token over ln 2, over the validation split's bytes per token.
  const auto index = json::parse(std::ifstream(shards + "/index.json"));
  const double bytes_per_token =
      index["splits"]["val"]["bytes"].get<double>() / index["splits"]["val"]["tokens"].get<double>();
  CHECK(summary["val_bpb"].get<double>() ==
        doctest::Approx(summary["val_loss"].get<double>() / std::log(2.0) / bytes_per_token).epsilon(1e-9));

  // Interrupted and resumed, over shards, bitwise.
  train_run(split, common + " parallel.dp=2 --stop-after 8");
  train_run(split, common + " parallel.dp=2 --resume");
  for (const auto& [step, loss] : b) {
    CAPTURE(step);
    CHECK(losses(split).at(step) == loss);
  }
  check_same_parameters(checkpoint(d2, 16), checkpoint(split, 16));

  // The checkpoint names its tokenizer; generation decodes with it, from the run or a consolidated file.
  const auto meta = json::parse(std::ifstream(checkpoint(d2, 16) + "/trainer.json"));
  CHECK(meta["tokenizer"]["hash"] == train::Tokenizer::load(bundled)->hash());
  REQUIRE(sh(kBin + " ckpt consolidate " + d2 + " -o " + dir + "/model.safetensors").rc == 0);
  const auto g1 = sh(kBin + " generate " + d2 + " --prompt 'The ' --tokens 20 --seed 3");
  const auto g2 = sh(kBin + " generate " + dir + "/model.safetensors --prompt 'The ' --tokens 20 --seed 3");
  INFO(g1.out);
  CHECK(g1.rc == 0);
  CHECK(g1.out == g2.out);
  CHECK(g1.out.rfind("The ", 0) == 0);
  // Another tokenizer (trained here by the CLI) is refused, not used to print gibberish.
  const auto other = dir + "/other.model";
  const auto tt = sh(kBin + " tokenizer train --vocab 700 " + text + " -o " + other);
  INFO(tt.out);
  REQUIRE(tt.rc == 0);
  CHECK(tt.out.find("bytes/token") != std::string::npos);
  const auto g3 = sh(kBin + " generate " + dir + "/model.safetensors --tokenizer " + other);
  CHECK(g3.rc == 1);
  CHECK(g3.out.find("was written with tokenizer " + bundled) != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE(
    "run: `fsdpp tokenize` killed mid-way leaves no shard in its output, only whole ones in its staging "
    "directory, and runs again") {
  const auto dir = fresh_dir("tokenize-killed");
  const auto text = dir + "/text", shards = dir + "/shards";
  fs::create_directories(text);
  // About 25 MB of text: several seconds of tokenizing.
  std::string all;
  for (const auto& e : fs::directory_iterator(train::fortunes_dir()))
    if (e.is_regular_file() && !e.is_symlink() && !e.path().has_extension())
      all += train::read_text_file(e.path().string());
  for (int i = 0; all.size() * i < 25'000'000; ++i) std::ofstream(text + "/part" + std::to_string(i)) << all;
  const std::string bundled = std::string(FSDPP_SOURCE_DIR) + "/recipes/tokenizers/fortunes-bpe-2048.model";
  const std::string cmd =
      kBin + " tokenize --tokenizer " + bundled + " " + text + " -o " + shards + " --shard-tokens 300000";
  FILE* p = popen(("exec " + cmd + " > " + dir + "/log 2>&1 & echo $!").c_str(), "r");
  REQUIRE(p);
  int pid = 0;
  REQUIRE(fscanf(p, "%d", &pid) == 1);
  pclose(p);
  // Kill it once the first shard is complete and the next one is being written.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  // Files ending in `suffix` in the output (recursive: the run's staging directory too).
  auto count = [&](const std::string& suffix, bool recursive = true) {
    int n = 0;
    if (fs::exists(shards))
      for (const auto& e : fs::recursive_directory_iterator(shards))
        n += e.path().string().ends_with(suffix) && (recursive || e.path().parent_path() == shards);
    return n;
  };
  while (count(".bin") < 1 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  REQUIRE(count(".bin") >= 1);
  CHECK_FALSE(fs::exists(shards + "/index.json"));
  CHECK(count(".bin", /*recursive=*/false) == 0);  // nothing under the output's own shard names
  // Every file under a shard's name in the staging directory is whole: the reader checks each
  // header against its size.
  std::string staging;
  for (const auto& e : fs::directory_iterator(shards))
    if (e.path().filename().string().rfind(".staging-", 0) == 0) staging = e.path();
  REQUIRE_FALSE(staging.empty());
  std::unique_ptr<train::ShardSet> partial;
  CHECK_NOTHROW(partial = std::make_unique<train::ShardSet>(staging, "train", 2048));
  if (partial) CHECK(partial->tokens() == 300000 * partial->segments());
  const auto again = sh(cmd);
  INFO(again.out);
  REQUIRE(again.rc == 0);
  CHECK(count(".tmp") == 0);
  CHECK_FALSE(fs::exists(staging));
  CHECK(fs::exists(shards + "/index.json"));
  fs::remove_all(dir);
}

// The line of a one-step run's log that starts with `prefix`; `env` as env(1) takes it.
std::string rank_log_line(const std::string& dir, const std::string& env, const std::string& args,
                          const std::string& prefix) {
  fs::remove_all(dir);
  const auto r = sh("env " + env + " " + kBin + " run " + kRecipe + " logging.output_dir=" + dir +
                    " train.steps=1 eval.interval=0 checkpoint.enabled=false " + args);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const auto at = r.out.find(prefix);
  REQUIRE(at != std::string::npos);
  return r.out.substr(at, r.out.find('\n', at) - at);
}

TEST_CASE(
    "run: ranks of a run with cpu.microbatch_threads start with OpenMP's spin shortened, unless the "
    "environment sets it") {
  const auto dir = fresh_dir("openmp-wait");
  const auto run_with = [&](const std::string& env, const std::string& args) {
    return rank_log_line(dir, "-u GOMP_SPINCOUNT -u OMP_WAIT_POLICY " + env,
                         "parallel.dp=1 train.grad_accum=2 " + args, "OpenMP: ");
  };
  CHECK(run_with("", "cpu.microbatch_threads=2") == std::string("OpenMP: idle threads spin ") +
                                                        kMicrobatchThreadsSpinCount +
                                                        " rounds, then sleep (GOMP_SPINCOUNT)");
  CHECK(run_with("", "") == "OpenMP: libgomp's own wait (300,000 spin rounds)");
  CHECK(run_with("GOMP_SPINCOUNT=2000", "cpu.microbatch_threads=2") ==
        "OpenMP: idle threads spin 2000 rounds, then sleep (GOMP_SPINCOUNT)");
  CHECK(run_with("OMP_WAIT_POLICY=passive", "cpu.microbatch_threads=2") == "OpenMP: OMP_WAIT_POLICY=passive");
  fs::remove_all(dir);
}

TEST_CASE(
    "run: ranks started with torchrun's variables and no launcher (rank 0 hosting the store) end without "
    "the store's connection warnings") {
  // Each rank's watchdog polls the store from its own connection; the server rank 0 hosts outlives
  // the communicator and waits at exit for every rank's watchdog to stop (WatchdogOptions::hosted).
  const auto dir = fresh_dir("no-launcher");
  const auto rank = [&](int r, int world, int port) {
    return fmt::format(
        "env WORLD_SIZE={} RANK={} LOCAL_RANK={} LOCAL_WORLD_SIZE={} MASTER_ADDR=127.0.0.1 MASTER_PORT={} "
        "OMP_NUM_THREADS=1 {} run {} logging.output_dir={} parallel.dp={} train.steps=2 eval.interval=0 "
        "checkpoint.enabled=false --overwrite",
        world, r, r, world, port, kBin, kRecipe, dir, world);
  };
  const auto check_quiet = [](const Result& r) {
    INFO(r.out);
    CHECK(r.rc == 0);
    CHECK(r.out.find("done: 2 steps") != std::string::npos);
    CHECK(r.out.find("recvValue failed") == std::string::npos);
    CHECK(r.out.find("Connection") == std::string::npos);
  };
  check_quiet(sh(rank(0, 1, 29751)));
  // Where rank 1 ends after rank 0, its last polls would find the server gone unless rank 0 waits
  // for it: without that wait about one try in four warned here. Several tries, since the order of
  // the two exits is the scheduler's.
  for (int attempt = 0; attempt < 8; ++attempt) {
    CAPTURE(attempt);
    const int port = 29752 + attempt;
    check_quiet(sh(rank(0, 2, port) + " & a=$!; " + rank(1, 2, port) +
                   " & b=$!; wait $a; ra=$?; wait $b; rb=$?; exit $((ra + rb))"));
  }
  fs::remove_all(dir);
}

TEST_CASE("run: outputs (metrics, plot, summary, trace) and capacity routing's dropped-token rate") {
  const auto dir = fresh_dir("outputs");
  const auto out = train_run(
      dir,
      "train.steps=6 logging.interval=2 eval.interval=3 parallel.dp=2 "
      "model.routing=capacity model.capacity_factor=0.5 checkpoint.enabled=false --trace --trace-steps 2");
  CHECK(out.find("validation loss") != std::string::npos);
  std::ifstream svg(dir + "/loss.svg");
  std::string s((std::istreambuf_iterator<char>(svg)), {});
  CHECK(s.find("<svg") == 0);
  CHECK(s.find("<polyline") != std::string::npos);
  const auto summary = json::parse(std::ifstream(dir + "/summary.json"));
  CHECK(summary["steps"] == 6);
  CHECK(summary["val_loss"].get<double>() > 0);
  CHECK(summary["step_ms_median"].get<double>() > 0);
  CHECK(!fs::exists(fs::path(dir) / "checkpoints"));  // checkpoint.enabled=false
  int evals = 0;
  std::ifstream m(dir + "/metrics/rank0.jsonl");
  for (std::string line; std::getline(m, line);) {
    const auto j = json::parse(line);
    if (j.contains("val_loss")) ++evals;
    if (j.contains("loss")) {
      // capacity 0.5: at least half of the assignments cannot fit.
      CHECK(j["dropped_fraction"].get<double>() >= 0.5);
      CHECK(j["tokens_per_s"].get<double>() > 0);
    }
  }
  CHECK(evals == 2);
  const auto trace = json::parse(std::ifstream(dir + "/trace.json"));
  std::set<int> pids;
  std::map<int, int> steps;  // traced steps, by rank
  bool comm = false;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    pids.insert(e["pid"].get<int>());
    comm |= e["cat"].get<std::string>().rfind("comm", 0) == 0;
    if (e["cat"] == "steps") ++steps[e["pid"].get<int>()];
  }
  CHECK(pids == std::set<int>{0, 1});
  CHECK(steps == std::map<int, int>{{0, 2}, {1, 2}});  // --trace-steps 2
  // Each rank's entry gives the system clock less the monotonic clock, as read here now (the
  // machine's clocks do not step within a test).
  const double now_offset_us = double(std::chrono::duration_cast<std::chrono::microseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count() -
                                      std::chrono::duration_cast<std::chrono::microseconds>(
                                          std::chrono::steady_clock::now().time_since_epoch())
                                          .count());
  int offsets = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "process_name") {
      CAPTURE(e.dump());
      REQUIRE(e["args"].contains("monotonic_offset_us"));
      CHECK(std::abs(e["args"]["monotonic_offset_us"].get<double>() - now_offset_us) < 5e4);
      ++offsets;
    }
  CHECK(offsets == 2);
  CHECK(comm);
  fs::remove_all(dir);
}

namespace {

// Processes whose command line mentions `needle` (our own ranks, by their output directory).
int processes_mentioning(const std::string& needle) {
  int n = 0;
  for (const auto& e : fs::directory_iterator("/proc")) {
    std::ifstream f(e.path() / "cmdline");
    std::string cmd((std::istreambuf_iterator<char>(f)), {});
    if (cmd.find(needle) != std::string::npos && cmd.find("fsdpp_test_run") == std::string::npos) ++n;
  }
  return n;
}

}  // namespace

TEST_CASE(
    "run: every traced step issues the same collectives in the same order and makes its tensors on its "
    "device (capture-ready), dp and pp") {
  for (const std::string layout :
       {"parallel.dp=2", "parallel.pp=2 parallel.microbatches=2", "parallel.dp=2 parallel.ep=2"}) {
    CAPTURE(layout);
    const auto dir = fresh_dir("same-steps");
    // The first step also runs under DefaultDeviceCheck: every tensor it makes is on its device.
    const auto r = sh("FSDPP_CHECK_DEVICES=1 " + kBin + " run " + kRecipe + " logging.output_dir=" + dir +
                      " train.steps=6 model.routing=capacity " + layout + " --trace");
    INFO(r.out);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("FSDPP_CHECK_DEVICES: the step makes every tensor on its device") != std::string::npos);
    const auto trace = json::parse(std::ifstream(dir + "/trace.json"));
    std::map<std::pair<int, int>, std::string> track;  // (pid, tid) -> track name
    for (const auto& e : trace["traceEvents"])
      if (e["ph"] == "M" && e["name"] == "thread_name") track[{e["pid"], e["tid"]}] = e["args"]["name"];
    std::map<int, std::vector<std::pair<double, double>>> steps;        // pid -> step spans
    std::map<int, std::vector<std::tuple<double, std::string>>> comms;  // pid -> (start, what)
    std::map<int, std::set<std::string>> computed;                      // pid -> compute span names
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X") continue;
      const int pid = e["pid"];
      const std::string t = track[{pid, e["tid"].get<int>()}], name = e["name"];
      const double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
      if (t == "steps") steps[pid].emplace_back(ts, ts + dur);
      if (t.rfind("comm", 0) == 0) comms[pid].emplace_back(ts, t + ": " + name);
      if (t == "compute") computed[pid].insert(name);
    }
    REQUIRE(steps.size() == 2);
    // Pipelined, each stage's computations are on its rank's compute track (PyTorch's notation).
    if (layout.find("parallel.pp=2") != std::string::npos) {
      CHECK(computed[0] ==
            std::set<std::string>{"pipeline step", "clip", "optimizer", "0F0", "0F1", "0B0", "0B1"});
      CHECK(computed[1] ==
            std::set<std::string>{"pipeline step", "clip", "optimizer", "1F0", "1F1", "1B0", "1B1"});
    }
    for (auto& [pid, spans] : steps) {
      CAPTURE(pid);
      REQUIRE(spans.size() >= 3);
      std::sort(comms[pid].begin(), comms[pid].end());
      std::vector<std::vector<std::string>> per_step;
      for (const auto& [from, to] : spans) {
        per_step.emplace_back();
        for (const auto& [ts, what] : comms[pid])
          if (ts >= from && ts <= to) per_step.back().push_back(what);
      }
      CHECK(!per_step[0].empty());
      for (size_t s = 1; s < per_step.size(); ++s) CHECK(per_step[s] == per_step[0]);
      // Expert parallelism's exchanges are traced: both ways in forward and in backward.
      const auto exchanges = std::count_if(
          per_step[0].begin(), per_step[0].end(),
          [](const std::string& what) { return what.find("moe all_to_all") != std::string::npos; });
      CHECK((exchanges > 0) == (layout.find("parallel.ep") != std::string::npos));
      if (exchanges > 0) {  // as many of each: forward and backward, dispatch and combine
        auto count = [&](const std::string& label) {
          return std::count_if(per_step[0].begin(), per_step[0].end(), [&](const std::string& what) {
            const auto at = what.find(label);
            return at != std::string::npos && at + label.size() == what.size();
          });
        };
        const auto dispatch = count("moe all_to_all dispatch");
        CHECK(dispatch > 0);
        for (const char* label : {"moe all_to_all combine", "moe all_to_all dispatch (backward)",
                                  "moe all_to_all combine (backward)"}) {
          CAPTURE(label);
          CHECK(count(label) == dispatch);
        }
      }
    }
  }
}

TEST_CASE("run: a rank killed mid-step stops the run, is named, and --resume continues") {
  const auto dir = fresh_dir("killed"), ref = fresh_dir("killed-ref");
  const std::string args = "train.steps=12 checkpoint.interval=4 logging.interval=1 parallel.dp=2";
  train_run(ref, args);
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = sh("FSDPP_FAULT=kill:rank=1:step=7 " + kBin + " run " + kRecipe +
                    " logging.output_dir=" + dir + " " + args);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.out);
  CHECK(r.rc == 137);
  CHECK(r.out.find("rank 1") != std::string::npos);
  CHECK(r.out.find("SIGKILL") != std::string::npos);
  CHECK(secs < 10);
  CHECK(processes_mentioning(dir) == 0);
  CHECK(fs::path(*train::latest_checkpoint(dir)).filename() == "step-00000004");
  train_run(dir, args + " --resume");
  const auto a = losses(ref), b = losses(dir);
  for (int64_t step = 5; step <= 12; ++step) {
    CAPTURE(step);
    CHECK(b.at(step) == a.at(step));
  }
  fs::remove_all(dir);
  fs::remove_all(ref);
}

TEST_CASE(
    "run: SIGKILL during a checkpoint write leaves the previous checkpoint, and --resume continues from it") {
  const auto dir = fresh_dir("ckpt-fire"), ref = fresh_dir("ckpt-fire-ref");
  const std::string args = "train.steps=12 checkpoint.interval=4 logging.interval=1 parallel.dp=2";
  train_run(ref, args);
  const auto r = sh("FSDPP_FAULT=kill_in_checkpoint:rank=1:step=8 " + kBin + " run " + kRecipe +
                    " logging.output_dir=" + dir + " " + args);
  INFO(r.out);
  CHECK(r.rc == 137);
  // Rank 1 died with its files of step 8 written but the checkpoint not committed. Rank 0 may
  // have removed the partial directory (a failed checkpoint does) before the launcher stopped it.
  CHECK(r.out.find("kill_in_checkpoint at step 8") != std::string::npos);
  CHECK_FALSE(fs::exists(checkpoint(dir, 8)));
  REQUIRE(train::latest_checkpoint(dir));
  CHECK(fs::path(*train::latest_checkpoint(dir)).filename() == "step-00000004");
  CHECK_NOTHROW(fsdp::read_full_parameters(checkpoint(dir, 4)));
  const auto out = train_run(dir, args + " --resume");
  CHECK(out.find("step-00000004") != std::string::npos);
  check_same_parameters(checkpoint(ref, 12), checkpoint(dir, 12));
  fs::remove_all(dir);
  fs::remove_all(ref);
}

TEST_CASE(
    "run: damaged checkpoints are named by `ckpt verify`, and --resume falls back to the newest that "
    "verifies") {
  const auto dir = fresh_dir("damaged"), ref = fresh_dir("damaged-ref");
  const std::string args =
      "train.steps=12 checkpoint.interval=4 checkpoint.keep=3 logging.interval=1 parallel.dp=2";
  train_run(ref, args);
  train_run(dir, args + " --stop-after 8");
  const auto ok = sh(kBin + " ckpt verify " + dir);
  INFO(ok.out);
  CHECK(ok.rc == 0);
  CHECK(ok.out.find(checkpoint(dir, 8) + ": ok (") != std::string::npos);
  CHECK(ok.out.find(checkpoint(dir, 4) + ": ok (") != std::string::npos);

  // Each kind of damage, on a copy of step 4: named by file.
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  auto write = [](const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  };
  const auto copy = fresh_dir("damaged-copy");
  struct Damage {
    std::string file, what;
    std::function<std::string(std::string)> change;
  };
  const std::vector<Damage> damage = {
      {"rank1.safetensors", "rank1.safetensors is damaged: its CRC-32C is",
       [](std::string b) {
         b[b.size() / 2] ^= 0x40;
         return b;
       }},
      {"rank0.safetensors", "rank0.safetensors is ",
       [](std::string b) { return b.substr(0, b.size() - 100); }},
      {"rank1.json", "rank1.json is damaged: its CRC-32C is",
       [](std::string b) {
         b[b.find("\"row_offset\": ") + 14] ^= 0x01;
         return b;
       }},  // a digit: still valid JSON
      {"trainer.json", "trainer.json is damaged: its contents do not match",
       [](std::string b) {
         b[b.find("\"step\": 4") + 8] = '5';
         return b;
       }},
  };
  for (const auto& d : damage) {
    CAPTURE(d.file);
    fs::remove_all(copy);
    fs::copy(checkpoint(dir, 4), copy);
    write(copy + "/" + d.file, d.change(read(copy + "/" + d.file)));
    const auto r = sh(kBin + " ckpt verify " + copy);
    INFO(r.out);
    CHECK(r.rc == 1);
    CHECK(r.out.find(copy + ": DAMAGED: checkpoint: " + copy + "/" + d.what) != std::string::npos);
  }
  fs::remove_all(copy);

  // The newest checkpoint damaged: --resume says so, takes step 4, and ends where the
  // uninterrupted run did, bit for bit.
  const auto file = checkpoint(dir, 8) + "/rank1.safetensors";
  auto bytes = read(file);
  bytes[bytes.size() - 1] ^= 0x01;
  write(file, bytes);
  const auto bad = sh(kBin + " ckpt verify " + dir);
  CHECK(bad.rc == 1);
  CHECK(bad.out.find(checkpoint(dir, 8) + ": DAMAGED: checkpoint: " + file + " is damaged") !=
        std::string::npos);
  CHECK(bad.out.find(checkpoint(dir, 4) + ": ok (") != std::string::npos);
  const auto out = train_run(dir, args + " --resume");
  CHECK(out.find("--resume: skipping " + checkpoint(dir, 8) + ": checkpoint: " + file + " is damaged") !=
        std::string::npos);
  CHECK(out.find("resumed from " + checkpoint(dir, 4)) != std::string::npos);
  check_same_parameters(checkpoint(ref, 12), checkpoint(dir, 12));
  fs::remove_all(dir);
  fs::remove_all(ref);
}

TEST_CASE(
    "run: --max-restarts starts the group again from its latest checkpoint, and gives up on a failure that "
    "repeats") {
  const auto dir = fresh_dir("restart"), ref = fresh_dir("restart-ref");
  const std::string args = "train.steps=12 checkpoint.interval=4 logging.interval=1 parallel.dp=2";
  train_run(ref, args);
  // Rank 1 killed as step 7 begins, on the first start only: one restart finishes the run, bitwise
  // equal to the run that never failed.
  auto r = sh("FSDPP_FAULT=kill:rank=1:step=7 " + kBin + " run " + kRecipe + " logging.output_dir=" + dir +
              " " + args + " --max-restarts 1");
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK(r.out.find("fsdpp launch: restart 1 of 1: starting every rank again (the run resumes from its latest "
                   "checkpoint) after: rank 1 (pid") != std::string::npos);
  CHECK(r.out.find("was killed by SIGKILL") != std::string::npos);
  CHECK(r.out.find("restart 1: continuing from the latest checkpoint") != std::string::npos);
  CHECK(r.out.find("resumed from " + checkpoint(dir, 4)) != std::string::npos);
  check_same_parameters(checkpoint(ref, 12), checkpoint(dir, 12));
  // Visible in the metrics (the lines the restarted group wrote) and the summary.
  std::map<int64_t, int> restart_of_step;
  std::ifstream f(fs::path(dir) / "metrics" / "rank0.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = json::parse(line);
    if (j.contains("loss")) restart_of_step[j["step"]] = j.value("restart", 0);
  }
  CHECK(restart_of_step.size() == 12);
  CHECK(restart_of_step[4] == 0);
  CHECK(restart_of_step[5] == 1);
  CHECK(restart_of_step[12] == 1);
  CHECK(json::parse(std::ifstream(fs::path(dir) / "summary.json"))["restarts"] == 1);

  // Without restarts the run fails as before.
  r = sh("FSDPP_FAULT=kill:rank=1:step=7 " + kBin + " run " + kRecipe + " logging.output_dir=" + dir + " " +
         args + " --overwrite --max-restarts 0");
  CHECK(r.rc == 137);
  CHECK(r.out.find("fsdpp launch: restart") == std::string::npos);
  // A failure on every start: two restarts, then the cause.
  r = sh("FSDPP_FAULT=kill:rank=1:step=7:attempt=any " + kBin + " run " + kRecipe +
         " logging.output_dir=" + dir + " " + args + " --overwrite --max-restarts 2");
  INFO(r.out);
  CHECK(r.rc == 137);
  CHECK(r.out.find("restart 2 of 2:") != std::string::npos);
  CHECK(r.out.find("fsdpp launch: restart 3") == std::string::npos);
  CHECK(r.out.find("fsdpp launch: giving up after 2 restarts; the last failure: rank 1 (pid") !=
        std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(ref);
}

TEST_CASE(
    "run: model.init_from starts from full weights written by fsdpp or by safetensors.torch, and names bad "
    "tensors") {
  const auto a = fresh_dir("init-a"), fresh = fresh_dir("init-fresh"), b = fresh_dir("init-b"),
             c = fresh_dir("init-c");
  const std::string args =
      "train.steps=3 logging.interval=1 parallel.dp=2 eval.interval=0 checkpoint.enabled=false";
  train_run(a, "train.steps=8 logging.interval=1 parallel.dp=2 eval.interval=0");
  const auto weights = a + "/model.safetensors", resaved = a + "/resaved.safetensors";
  REQUIRE(sh(kBin + " ckpt consolidate " + a + " -o " + weights).rc == 0);
  const std::string resave =
      kPython + " " + std::string(FSDPP_SOURCE_DIR) + "/tests/train/resave_safetensors.py " + weights;
  const auto r = sh(resave + " " + resaved);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  train_run(fresh, args);
  const auto from_fsdpp = train_run(b, args + " model.init_from=" + weights);
  CHECK(from_fsdpp.find("model: weights from " + weights) != std::string::npos);
  train_run(c, args + " model.init_from=" + resaved);
  const auto lf = losses(fresh), lb = losses(b), lc = losses(c);
  REQUIRE(lb.size() == 3);
  CHECK(lb.at(1) < lf.at(1) - 0.2);  // it starts where run a ended, not from the seeded weights
  CHECK(lc == lb);                   // PyTorch's writer, the same weights: the same run, bit for bit
  // A tensor missing, one of another shape, a path that is not there: each named.
  for (const std::string how : {"drop", "reshape"}) {
    const auto bad = a + "/" + how + ".safetensors";
    const auto name = sh(resave + " " + bad + " " + how);
    REQUIRE(name.rc == 0);
    const std::string tensor = name.out.substr(0, name.out.find('\n'));
    const auto e = sh(kBin + " run " + kRecipe + " logging.output_dir=" + fresh_dir("init-bad") + " " + args +
                      " model.init_from=" + bad);
    INFO(e.out);
    CHECK(e.rc != 0);
    CHECK(e.out.find(how == "drop" ? bad + ": parameter '" + tensor + "' is missing"
                                   : bad + ": '" + tensor + "' has shape [") != std::string::npos);
  }
  const auto missing = sh(kBin + " run " + kRecipe + " logging.output_dir=" + fresh_dir("init-none") + " " +
                          args + " model.init_from=/nonexistent/w.safetensors");
  CHECK(missing.rc == 2);
  CHECK(missing.out.find("model.init_from: /nonexistent/w.safetensors is neither a file") !=
        std::string::npos);
  for (const auto& d : {a, fresh, b, c}) fs::remove_all(d);
}

TEST_CASE(
    "run: a PyTorch model written from the README's description gives fsdpp's logits from a consolidated "
    "file") {
  const auto dir = fresh_dir("torch-logits");
  train_run(dir, "train.steps=4 logging.interval=1 parallel.dp=2 eval.interval=0");
  const auto weights = dir + "/model.safetensors", case_file = dir + "/case.safetensors";
  REQUIRE(sh(kBin + " ckpt consolidate " + dir + " -o " + weights).rc == 0);
  auto model = train::load_model(weights);
  const auto tokens = at::randint(256, {2, 16}, at::detail::createCPUGenerator(3));
  at::Tensor logits;
  {
    at::NoGradGuard g;
    logits = model->forward(tokens);
  }
  write_safetensors(case_file, {{"tokens", tokens}, {"logits", logits}});
  const std::string ref =
      kPython + " " + std::string(FSDPP_SOURCE_DIR) + "/tests/train/torch_reference_model.py ";
  const auto r = sh(ref + weights + " " + case_file);
  INFO(r.out);
  CHECK(r.rc == 0);
  // The comparison can fail: other logits (a changed model) are found.
  write_safetensors(case_file, {{"tokens", tokens}, {"logits", logits * 1.01}});
  CHECK(sh(ref + weights + " " + case_file).rc == 1);
  // Capacity routing, tight enough that assignments are dropped: the same weights under a config
  // that says so, in the file's metadata as consolidate writes it.
  auto config = model->config();
  config.routing = "capacity";
  config.capacity_factor = 0.5;
  auto capped = models::MoETransformer(config);
  auto weights_file = read_safetensors(weights);
  train::load_full_weights(*capped, weights_file.tensors, weights);
  {
    at::NoGradGuard g;
    logits = capped->forward(tokens);
  }
  CHECK(capped->router_stats().dropped_fraction() > 0.2);
  const auto capped_weights = dir + "/capacity.safetensors";
  write_safetensors(capped_weights, weights_file.tensors,
                    {{"format", "pt"}, {"fsdpp.model_config", train::to_json(config).dump()}});
  write_safetensors(case_file, {{"tokens", tokens}, {"logits", logits}});
  const auto rc = sh(ref + capped_weights + " " + case_file);
  INFO(rc.out);
  CHECK(rc.rc == 0);
  // and the dropless logits are not what capacity routing gives.
  write_safetensors(case_file, {{"tokens", tokens}, {"logits", model->forward(tokens).detach()}});
  CHECK(sh(ref + capped_weights + " " + case_file).rc == 1);
  fs::remove_all(dir);
}

TEST_CASE("run: a rank that skips one all_gather: every rank dumps, the run ends, the analysis names it") {
  const auto dir = fresh_dir("hang");
  const auto t0 = std::chrono::steady_clock::now();
  const auto r =
      sh("FSDPP_FAULT=skip_all_gather:rank=1:count=5 " + kBin + " run " + kRecipe +
         " logging.output_dir=" + dir + " parallel.dp=4 train.global_batch=8 dist.watchdog_timeout_s=2");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.out);
  CHECK(r.rc == 124);
  CHECK(secs < 2 + 10);
  CHECK(r.out.find("fsdpp watchdog: rank 0:") != std::string::npos);
  for (int rank = 0; rank < 4; ++rank)
    CHECK(fs::exists(fs::path(dir) / "flight_records" / ("rank" + std::to_string(rank) + ".json")));
  const auto a = sh(kBin + " fr analyze " + dir + "/flight_records");
  INFO(a.out);
  CHECK(a.rc == 0);
  CHECK(a.out.find("rank(s) 1 issued") != std::string::npos);
  CHECK(a.out.find("fsdp") != std::string::npos);
  CHECK(a.out.find("all_gather") != std::string::npos);
  CHECK(processes_mentioning(dir) == 0);
  fs::remove_all(dir);
}

TEST_CASE("run: with dist.check_collectives, ranks that disagree fail at once, naming both sides") {
  const auto dir = fresh_dir("mismatch");
  const auto r = sh("FSDPP_FAULT=skip_all_gather:rank=1:count=5 " + kBin + " run " + kRecipe +
                    " logging.output_dir=" + dir +
                    " parallel.dp=2 dist.check_collectives=true dist.watchdog_timeout_s=60");
  INFO(r.out);
  CHECK(r.rc != 0);
  CHECK(r.rc != 124);  // the check, not the watchdog
  CHECK(r.out.find("consistency check failed: this rank issues") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("run: bfloat16 compute with float32 router gates and norms trains, at dp=2 and at pp=2") {
  const std::string mp =
      "precision.param_dtype=bfloat16 'precision.overrides=[{\"match\": \"*.router.gate.weight\", "
      "\"param_dtype\": \"float32\", \"grad_dtype\": \"float32\"}, {\"match\": \"*norm*\", \"param_dtype\": "
      "\"float32\"}]' "
      "train.steps=20 logging.interval=1 eval.interval=0";
  for (const std::string layout : {"parallel.dp=2", "parallel.pp=2 parallel.microbatches=2"}) {
    CAPTURE(layout);
    const auto dir = fresh_dir("bf16");
    train_run(dir, mp + " " + layout);
    const auto l = losses(dir);
    CHECK(l.at(20) < l.at(1) - 1.0);
    // The optimizer's shards stay float32 whatever the compute dtype.
    for (const auto& [name, t] : fsdp::read_full_parameters(checkpoint(dir, 20))) {
      CAPTURE(name);
      CHECK((t.scalar_type() == at::kFloat));
    }
    fs::remove_all(dir);
  }
}
