// The fsdpp command line.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <chrono>
#include <climits>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>

#include "fsdpp/comm/fault.hpp"
#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/comm/init.hpp"
#include "fsdpp/comm/launch.hpp"
#include "fsdpp/base/blas.hpp"
#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"
#include "fsdpp/train/chat_data.hpp"
#include "fsdpp/base/mkl_vml.hpp"
#include "fsdpp/base/openmp_wait.hpp"
#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/table.hpp"
#include "fsdpp/pipeline/visualize.hpp"
#include "fsdpp/train/checkpoints.hpp"
#include "fsdpp/train/generate.hpp"
#include "fsdpp/train/memory_estimate.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/run_lock.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "fsdpp/train/trainer.hpp"
#include "data_commands.hpp"
#include "generate_command.hpp"
#include "model_commands.hpp"
#include "tool_commands.hpp"

namespace {

using namespace fsdpp;
using namespace fsdpp::cli;

constexpr int kMaxRanks = 65536;

// What a person reads of an error: LibTorch's own text without its C++ stack trace, and never an
// empty line.
std::string user_message(const std::exception& e) {
  std::string text = e.what();
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) text = c10->what_without_backtrace();
  // LibTorch's errors rethrown inside ours carry the trace on.
  if (const auto at = text.find("\nException raised from "); at != std::string::npos) text.erase(at);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  if (text.empty()) text = fmt::format("an error without a message ({})", typeid(e).name());
  return text;
}

int run_launch(comm::LaunchOptions options) {
  const auto result = comm::launch(options);
  if (result.exit_code != 0) std::cerr << "fsdpp launch: failed: " << result.reason << "\n";
  return result.exit_code;
}

struct RunArgs {
  std::string recipe;
  std::vector<std::string> overrides;
  int nproc = 0;
  train::RunOptions options;
  int64_t stop_after = 0;
  int max_restarts = 0;
  bool share_gpu = false;
};

int run_recipe(RunArgs& a) {
  if (a.stop_after > 0) a.options.stop_after = a.stop_after;
  if (a.options.resume_with_changes) a.options.resume = true;
  if (comm::launched_by_launcher()) {
    // The recipe sets up the communicators; run_training checks it against the world size.
    const auto recipe = train::load_recipe(a.recipe, a.overrides);
    // A restarted group (fsdpp launch or torchrun with --max-restarts) continues from the latest
    // checkpoint, or starts afresh when the failure came before the first one.
    if (const char* n = std::getenv("TORCHELASTIC_RESTART_COUNT"); n && std::atoi(n) > 0) {
      a.options.restart = std::atoi(n);
      a.options.resume = !train::committed_checkpoints(recipe.output_dir()).empty();
      a.options.overwrite = !a.options.resume;
    }
    comm::InitOptions init;
    init.backend = recipe.train.device == train::Device::kCuda ? comm::Backend::kNccl : comm::Backend::kGloo;
    init.watchdog_timeout =
        std::chrono::milliseconds(static_cast<int64_t>(recipe.dist.watchdog_timeout_s * 1000));
    init.flight_record_dir = (std::filesystem::path(recipe.output_dir()) / "flight_records").string();
    if (recipe.dist.check_collectives) setenv("FSDPP_CHECK_COLLECTIVES", "1", /*overwrite=*/0);
    // The command line lets its users set these in the environment; a library user's program decides.
    init = comm::with_watchdog_from_env(init);
    const auto& fault = comm::arm_faults_from_env();
    auto world = comm::init_from_env(init);
    if (!fault.kind.empty() && !fault.disarmed && world.rank() == 0)
      std::cerr << fmt::format("fsdpp run: FSDPP_FAULT armed: {} on rank {} at {}\n", fault.kind, fault.rank,
                               fault.at);
    if (const char* order = std::getenv("FSDPP_CHECK_NCCL_ORDER");
        order && std::string(order) == "1" && init.backend == comm::Backend::kGloo && world.rank() == 0)
      std::cerr << "fsdpp run: Gloo under NCCL's ordering rules (FSDPP_CHECK_NCCL_ORDER=1, docs/comm.md)\n";
    train::run_training(recipe, std::move(world), a.options);
    return 0;
  }
  // Check everything before any rank starts.
  const auto recipe =
      train::load_recipe(a.recipe, a.overrides, a.nproc > 0 ? std::optional<int>(a.nproc) : std::nullopt);
  comm::check_injected_fault(
      recipe.world_size(),
      std::min(recipe.train.steps, a.stop_after > 0 ? a.stop_after : recipe.train.steps));
  train::check_memory(recipe, recipe.world_size());  // every rank on this machine
  // The run owns its output directory until every rank has ended (include/fsdpp/train/run_lock.hpp).
  std::optional<std::string> took_over;
  const auto lock = train::RunLock::acquire(recipe.output_dir(), "fsdpp run " + a.recipe, &took_over);
  if (took_over) std::cerr << "fsdpp run: note: " << *took_over << "\n";
  train::check_output_dir(recipe, a.options);
  if (const auto finished = train::finished_run(recipe, a.options)) {
    std::cout << "fsdpp run: " << *finished << std::endl;
    return 0;
  }
  comm::LaunchOptions o;
  o.nproc = recipe.world_size();
  o.max_restarts = a.max_restarts;
  o.share_gpu = a.share_gpu;
  o.env.push_back(std::string(train::RunLock::kHeldVariable) + "=1");
  o.command = {self_exe(), "run", a.recipe};
  // The command line's own process settings for its ranks (docs/performance.md), logged by the
  // ranks ("OpenMP: ..."); a program of one's own decides for itself.
  if (const auto spins =
          microbatch_threads_spin_count(recipe.cpu.microbatch_threads, openmp_wait_environment()))
    o.env.push_back("GOMP_SPINCOUNT=" + *spins);
  for (const auto& ov : a.overrides) o.command.push_back(ov);
  if (a.options.resume)
    o.command.push_back(a.options.resume_with_changes ? "--resume-with-changes" : "--resume");
  if (a.options.overwrite) o.command.push_back("--overwrite");
  if (a.options.trace)
    o.command.insert(o.command.end(), {"--trace", "--trace-steps", std::to_string(a.options.trace_steps)});
  if (a.stop_after > 0) o.command.insert(o.command.end(), {"--stop-after", std::to_string(a.stop_after)});
  return run_launch(o);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fsdpp: sharded and pipelined training on LibTorch"};
  app.require_subcommand(1);

  comm::LaunchOptions launch;
  int master_port = 0;
  bool no_prefix = false;
  auto* cmd_launch = app.add_subcommand(
      "launch", "start N local ranks with torchrun's environment: fsdpp launch --nproc N -- PROGRAM ARGS");
  cmd_launch->add_option("--nproc", launch.nproc, "ranks on this node")->check(CLI::Range(1, kMaxRanks));
  cmd_launch->add_option("--nnodes", launch.nnodes, "number of nodes")->check(CLI::Range(1, kMaxRanks));
  cmd_launch->add_option("--node-rank", launch.node_rank, "this node's index, 0-based")
      ->check(CLI::Range(0, kMaxRanks - 1));
  cmd_launch->add_option("--master-addr", launch.master_addr,
                         "address of node 0, where the rendezvous store runs (default 127.0.0.1)");
  cmd_launch->add_option("--master-port", master_port, "port of the store (default: a free port)")
      ->check(CLI::Range(0, 65535));
  cmd_launch->add_flag("--no-prefix", no_prefix, "do not prefix output lines with the rank");
  cmd_launch
      ->add_option("--max-restarts", launch.max_restarts,
                   "after a failure, start every rank again, up to N times (TORCHELASTIC_RESTART_COUNT)")
      ->check(CLI::Range(0, 1000));
  cmd_launch->add_flag(
      "--share-gpu", launch.share_gpu,
      "ranks share this node's GPUs (each gets its own NCCL_HOSTID; for correctness checks)");
  cmd_launch->add_option("command", launch.command, "program and arguments, after --")->required();

  int demo_nproc = 2;
  int64_t demo_max_mib = 16;
  auto* cmd_demo =
      app.add_subcommand("demo", "all-reduce check and bandwidth table across N local ranks (the main job)");
  cmd_demo->add_option("--nproc", demo_nproc, "ranks to start")->check(CLI::Range(1, 64));
  cmd_demo->add_option("--max-mib", demo_max_mib, "largest message, MiB")->check(CLI::Range(1, 1024));

  ShowOptions show;
  auto* cmd_schedule = app.add_subcommand("schedule", "pipeline schedules");
  cmd_schedule->require_subcommand(1);
  auto* cmd_show = cmd_schedule->add_subcommand(
      "show", "validate and simulate a schedule; print its timeline and bubble, write SVG and trace");
  auto* by_name = cmd_show->add_option("--schedule", show.schedule, "a registered schedule, e.g. 1F1B");
  auto* by_csv =
      cmd_show->add_option("--csv,--table", show.csv,
                           "an action table: CSV (one row per rank) or JSON ({\"ranks\": [[...], ...]})");
  by_name->excludes(by_csv);
  cmd_show->add_option("--pp", show.pp, "pipeline ranks")->check(CLI::Range(1, 1024));
  cmd_show->add_option("--microbatches", show.microbatches, "microbatches per step")
      ->check(CLI::Range(1, 100000));
  cmd_show
      ->add_option("--stages-per-rank", show.stages_per_rank,
                   "stages per rank (default 2 for V schedules, else 1)")
      ->check(CLI::Range(1, 64));
  cmd_show->add_option("--costs", show.costs, "costs of F,B,I,W (default 1,2,1,1)")
      ->expected(4)
      ->delimiter(',');
  cmd_show->add_option(
      "--out", show.out,
      "also write PREFIX.svg, PREFIX.trace.json, PREFIX.csv (lowered) and PREFIX.compute.csv");
  cmd_show
      ->add_option("--max-outstanding-sends", show.max_outstanding_sends,
                   "sends in flight per rank, at most (0: unlimited)")
      ->check(CLI::NonNegativeNumber);
  auto* show_fsdp = cmd_show->add_flag(
      "--fsdp", show.fsdp, "stages are sharded: add UNSHARD, RESHARD, REDUCE_GRAD and WAIT_REDUCE_GRAD");
  cmd_show->add_option("--defer-pp-recv", show.defer_pp_recv,
                       "post each receive as soon as its send is in the plan (false, the default, as "
                       "PyTorch 2.15) or as late as 2.15's defer_pp_recv posts it, before its use (true)");
  // The FSDP settings mean nothing without --fsdp: refused rather than ignored.
  cmd_show
      ->add_option("--defer-reduce-grad-wait", show.defer_reduce_grad_wait,
                   "with --fsdp: wait for a stage's REDUCE_GRAD right after it (false, the default, "
                   "as PyTorch 2.15) or before the rank's next one (true)")
      ->needs(show_fsdp);
  cmd_show
      ->add_option("--max-active-stages", show.max_active_stages,
                   "with --fsdp: stages of a rank kept gathered at once, the current one first (default 3)")
      ->check(CLI::Range(1, 64))
      ->needs(show_fsdp);
  cmd_show
      ->add_option("--unshard-lookahead", show.unshard_lookahead,
                   "with --fsdp: how far ahead each rank gathers: full (default), auto, or one "
                   "value per rank (1,2)")
      ->needs(show_fsdp);

  std::string fr_dir;
  auto* cmd_fr = app.add_subcommand("fr", "flight records");
  cmd_fr->require_subcommand(1);
  auto* cmd_analyze =
      cmd_fr->add_subcommand("analyze", "name the rank and operation behind a hang or a mismatch");
  cmd_analyze->add_option("dir", fr_dir, "directory of rank*.json flight records")->required();

  RunArgs run;
  auto* cmd_run =
      app.add_subcommand("run", "train a recipe: fsdpp run recipes/moe-small.json [key=value ...]");
  cmd_run->add_option("recipe", run.recipe, "recipe file (JSON)")->required()->check(CLI::ExistingFile);
  cmd_run->add_option("overrides", run.overrides,
                      "dotted overrides, for example optim.lr=1e-3 train.steps=100");
  cmd_run->add_option("--nproc", run.nproc, "ranks to start (must equal dp x pp; default dp x pp)")
      ->check(CLI::Range(1, kMaxRanks));
  cmd_run->add_flag("--resume", run.options.resume,
                    "continue from the latest checkpoint in the output directory");
  cmd_run->add_flag(
      "--resume-with-changes", run.options.resume_with_changes,
      "as --resume, also where the recipe changed what the checkpoint's data order or optimizer depend "
      "on (seed, batch, data, optim, steps); the log lists the changes");
  cmd_run->add_flag("--overwrite", run.options.overwrite,
                    "start afresh even if the output directory holds checkpoints");
  cmd_run->add_flag("--trace", run.options.trace,
                    "write trace.json: compute and communication of a few steps, all ranks");
  cmd_run
      ->add_option("--max-restarts", run.max_restarts,
                   "after a failure, start every rank again from the latest checkpoint, up to N times")
      ->check(CLI::Range(0, 1000));
  cmd_run->add_flag("--share-gpu", run.share_gpu,
                    "ranks share this machine's GPUs (each gets its own NCCL_HOSTID; for correctness checks, "
                    "timings mean little)");
  cmd_run
      ->add_option("--stop-after", run.stop_after,
                   "stop after this many steps (with a checkpoint), as if interrupted")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd_run
      ->add_option("--trace-steps", run.options.trace_steps,
                   "steps --trace covers, from the second step of the run")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();

  std::string validate_recipe;
  std::vector<std::string> validate_overrides;
  int validate_world = 0;
  auto* cmd_validate = app.add_subcommand("validate", "check a recipe without running it");
  cmd_validate->add_option("recipe", validate_recipe, "recipe file (JSON)")->required();
  cmd_validate->add_option("overrides", validate_overrides, "dotted overrides, as for run");
  cmd_validate->add_option("--nproc", validate_world, "the world size it will run at")
      ->check(CLI::Range(1, kMaxRanks));

  auto* cmd_ls = app.add_subcommand("ls", "list the bundled recipes and model configs");

  const auto generate_command = cli::add_generate_command(app);
  const auto data_commands = cli::add_data_commands(app);
  const auto model_commands = cli::add_model_commands(app);
  std::vector<std::string> ckpt_in;
  std::string ckpt_out;
  auto* cmd_ckpt = app.add_subcommand("ckpt", "checkpoints");
  cmd_ckpt->require_subcommand(1);
  auto* cmd_consolidate = cmd_ckpt->add_subcommand(
      "consolidate",
      "write one safetensors file of full parameters (PyTorch / Hugging Face names and loaders)");
  cmd_consolidate
      ->add_option("checkpoint", ckpt_in,
                   "run directory (its latest checkpoint) or checkpoint directory; with checkpoint.storage "
                   "\"local\", one per node")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd_consolidate->add_option("-o,--output", ckpt_out,
                              "output file (default: <first checkpoint>/model.safetensors)");
  bool ckpt_overwrite = false;
  cmd_consolidate->add_flag("--overwrite", ckpt_overwrite, "replace the output file if it exists");
  std::string verify_in;
  auto* cmd_verify = cmd_ckpt->add_subcommand(
      "verify", "check a checkpoint's files against their sizes and CRC-32C checksums, without a model");
  cmd_verify
      ->add_option(
          "checkpoint", verify_in,
          "checkpoint directory, run directory (every checkpoint in it), or a run's checkpoints/latest")
      ->required()
      ->check(CLI::ExistingPath);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitBadInput;  // --help is a ParseError too, and exits 0
  }
  try {
    if (cmd_launch->parsed()) {
      launch.master_port = static_cast<uint16_t>(master_port);
      launch.prefix_output = !no_prefix;
      return run_launch(launch);
    }
    if (cmd_run->parsed()) return run_recipe(run);
    if (cmd_validate->parsed()) {
      const auto r =
          train::load_recipe(validate_recipe, validate_overrides,
                             validate_world > 0 ? std::optional<int>(validate_world) : std::nullopt);
      const auto memory = train::check_memory(r, r.world_size());  // refuses what cannot fit
      const auto& par = r.parallel;
      std::vector<std::string> dp_parts;
      if (par.dp_replicate > 1)
        dp_parts.push_back(fmt::format("{} replicas x {} shards", par.dp_replicate, par.dp_shard()));
      if (par.ep > 1)
        dp_parts.push_back(fmt::format("ep {}: {} of {} experts per rank, sharded over {} rank{}", par.ep,
                                       r.model.experts / par.ep, r.model.experts, par.expert_shard(),
                                       par.expert_shard() > 1 ? "s" : ""));
      std::cout << fmt::format(
          "{}: valid ({:.2f}M-parameter model, dp {}{} x pp {} = {} ranks, {} steps of {} sequences)\n",
          validate_recipe, r.model.parameter_count() / 1e6, par.dp,
          dp_parts.empty() ? "" : fmt::format(" ({})", fmt::join(dp_parts, "; ")), par.pp, r.world_size(),
          r.train.steps, r.train.global_batch);
      std::cout << memory << "\n";
      for (const auto& u : train::unmatched_overrides(r))
        std::cout << fmt::format("warning: {} matches no parameter of this model, and changes nothing\n", u);
      if (r.train.device == train::Device::kCuda) {
        std::string why;
        if (const int gpus = comm::cuda_device_count(&why); gpus == 0)
          std::cout << fmt::format(
              "note: this recipe trains on GPUs (train.device \"cuda\"), and this machine has "
              "none ({}); it runs where each local rank has one\n",
              why);
      }
      return 0;
    }
    if (cmd_ls->parsed()) return list_bundled();
    if (const int rc = cli::run_generate_command(*generate_command); rc >= 0) return rc;
    if (cmd_consolidate->parsed()) {
      namespace fs = std::filesystem;
      const auto out =
          ckpt_out.empty() ? (fs::path(ckpt_in.front()) / "model.safetensors").string() : ckpt_out;
      const auto dir = train::consolidate_checkpoint(ckpt_in, out, ckpt_overwrite);
      std::cout << fmt::format("wrote {} from {}\n", out, dir);
      return 0;
    }
    if (cmd_verify->parsed()) return verify_checkpoints(verify_in);
    if (const int status = cli::run_data_commands(*data_commands); status >= 0) return status;
    if (const int status = cli::run_model_commands(*model_commands); status >= 0) return status;
    if (cmd_analyze->parsed()) {
      bool found = false;
      std::cout << comm::analyze_flight_records(fr_dir, &found);
      return 0;
    }
    if (cmd_show->parsed()) {
      if (show.schedule.empty() && show.csv.empty())
        throw std::invalid_argument("schedule show: give --schedule NAME or --csv FILE");
      return schedule_show(show);
    }
    if (cmd_demo->parsed()) {
      if (comm::launched_by_launcher()) return demo_worker(demo_max_mib << 20);
      comm::LaunchOptions o;
      o.nproc = demo_nproc;
      o.command = {self_exe(), "demo", "--max-mib", std::to_string(demo_max_mib)};
      return run_launch(o);
    }
  } catch (const train::RecipeError& e) {
    std::cerr << "fsdpp: invalid recipe: " << user_message(e) << "\n";
    return kExitBadInput;
  } catch (const std::invalid_argument& e) {
    std::cerr << "fsdpp: " << user_message(e) << "\n";
    return kExitBadInput;
  } catch (const BadInput& e) {
    std::cerr << "fsdpp: " << user_message(e) << "\n";
    return kExitBadInput;
  } catch (const pipeline::ScheduleError& e) {  // a schedule table or settings given on the command line
    std::cerr << "fsdpp: " << user_message(e) << "\n";
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::cerr << "fsdpp: error: " << user_message(e) << "\n";
    return kExitFailed;
  }
  return 0;
}
