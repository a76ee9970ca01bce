// The fsdpp command line.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <climits>
#include <fstream>
#include <iostream>

#include "dist/flight_recorder.hpp"
#include "dist/init.hpp"
#include "dist/launch.hpp"
#include "fsdpp/blas.hpp"
#include "pipeline/plan.hpp"
#include "pipeline/table.hpp"
#include "pipeline/visualize.hpp"

namespace {

using namespace fsdpp;

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find the fsdpp executable (/proc/self/exe)");
  return std::string(buf, n);
}

int run_launch(dist::LaunchOptions options) {
  const auto result = dist::launch(options);
  if (result.exit_code != 0)
    std::cerr << "fsdpp launch: failed: " << result.reason << "\n";
  return result.exit_code;
}

// The demo job: every rank checks an all-reduce against its closed form, then rank 0 prints the
// all-reduce bandwidth table (nccl-tests convention: bus bandwidth = algbw * 2(n-1)/n).
int demo_worker(int64_t max_bytes) {
  auto comm = dist::init_from_env();
  const int rank = comm.rank(), n = comm.size();
  if (rank == 0) {
    std::cout << describe(probe_blas()) << "\n";
    std::cout << fmt::format("world: {} ranks over {}\n", n, comm.backend());
  }
  // sum over ranks of (rank + 1) is n(n+1)/2 in every element
  auto t = at::full({1 << 16}, rank + 1, at::kFloat);
  comm.all_reduce(t).wait();
  const float expected = n * (n + 1) / 2.0f;
  if (!at::all(t == expected).item<bool>()) {
    std::cerr << fmt::format("rank {}: all_reduce gave {} instead of {}\n", rank,
                             t[0].item<float>(), expected);
    return 1;
  }
  if (rank == 0) {
    std::cout << fmt::format("all_reduce check: sum of (rank+1) over {} ranks = {} on every rank\n",
                             n, expected);
    std::cout << fmt::format("{:>10} {:>6} {:>12} {:>12} {:>12}\n", "bytes", "iters", "time (us)",
                             "algbw GB/s", "busbw GB/s");
  }
  for (int64_t bytes = 4 << 10; bytes <= max_bytes; bytes *= 4) {
    auto buf = at::ones({bytes / 4}, at::kFloat);
    comm.all_reduce(buf).wait();  // warm-up
    // Every rank runs the same number of iterations: rank 0's choice is broadcast.
    auto iters = at::zeros({1}, at::kLong);
    if (rank == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      comm.all_reduce(buf).wait();
      const double once = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      iters.fill_(std::max<int64_t>(3, std::min<int64_t>(200, static_cast<int64_t>(0.25 / once))));
    } else {
      comm.all_reduce(buf).wait();
    }
    comm.broadcast(iters).wait();
    comm.barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters.item<int64_t>(); ++i) comm.all_reduce(buf).wait();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                        iters.item<int64_t>();
    if (rank == 0) {
      const double algbw = bytes / secs / 1e9;
      std::cout << fmt::format("{:>10} {:>6} {:>12.1f} {:>12.3f} {:>12.3f}\n", bytes,
                               iters.item<int64_t>(), secs * 1e6, algbw,
                               algbw * 2.0 * (n - 1) / n);
    }
  }
  comm.barrier().wait();
  return 0;
}

struct ShowOptions {
  std::string schedule, csv, out = "schedule";
  int pp = 2, stages_per_rank = 1, microbatches = 4, max_outstanding_sends = 0;
  bool fsdp = false;
  std::vector<double> costs{1, 2, 1, 1};
};

// Validates and simulates a schedule; prints the timeline and bubbles, writes an SVG and a trace.
int schedule_show(const ShowOptions& o) {
  using namespace fsdpp::pipeline;
  std::unique_ptr<Schedule> schedule;
  if (!o.csv.empty()) {
    schedule = std::make_unique<TableSchedule>(o.csv, load_table(o.csv));
  } else {
    schedule = make_schedule(o.schedule);
  }
  const ScheduleSpec spec{o.pp, o.stages_per_rank, o.microbatches};
  const auto plan = make_plan(*schedule, spec, o.fsdp, o.max_outstanding_sends);
  const Costs costs{o.costs[0], o.costs[1], o.costs[2], o.costs[3], 0};
  const auto sim = simulate(plan.lowered, plan.owner, costs, o.max_outstanding_sends);
  const std::string title = fmt::format("{} pp={} stages/rank={} microbatches={}", schedule->name(),
                                        spec.pp, spec.stages_per_rank, spec.microbatches);
  std::cout << title << " (costs F=" << costs.forward << " B=" << costs.backward
            << " I=" << costs.backward_input << " W=" << costs.backward_weight << ")\n"
            << render_timeline(sim);
  for (size_t r = 0; r < plan.lowered.size(); ++r)
    std::cout << fmt::format("rank {}: {} actions after lowering, peak live activations {}, peak "
                             "receive buffers {}\n",
                             r, plan.lowered[r].size(), sim.peak_activations[r], sim.peak_recv_buffers[r]);
  std::cout << fmt::format("mean bubble fraction {:.3f}, step time {} units\n", sim.mean_bubble(), sim.makespan);
  std::ofstream(o.out + ".svg") << render_svg(sim, title);
  std::ofstream(o.out + ".trace.json") << chrome_trace(sim);
  std::ofstream csv(o.out + ".csv");
  write_csv(csv, plan.lowered);
  std::cout << "wrote " << o.out << ".svg, " << o.out << ".trace.json and " << o.out << ".csv (lowered)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fsdpp: sharded and pipelined training on LibTorch"};
  app.require_subcommand(1);

  dist::LaunchOptions launch;
  int master_port = 0;
  bool no_prefix = false;
  auto* cmd_launch = app.add_subcommand(
      "launch", "start N local ranks with torchrun's environment: fsdpp launch --nproc N -- PROGRAM ARGS");
  cmd_launch->add_option("--nproc", launch.nproc, "ranks on this node")->check(CLI::PositiveNumber);
  cmd_launch->add_option("--nnodes", launch.nnodes, "number of nodes")->check(CLI::PositiveNumber);
  cmd_launch->add_option("--node-rank", launch.node_rank, "this node's index, 0-based")
      ->check(CLI::NonNegativeNumber);
  cmd_launch->add_option("--master-addr", launch.master_addr,
                         "address of node 0, where the rendezvous store runs (default 127.0.0.1)");
  cmd_launch->add_option("--master-port", master_port, "port of the store (default: a free port)")
      ->check(CLI::Range(0, 65535));
  cmd_launch->add_flag("--no-prefix", no_prefix, "do not prefix output lines with the rank");
  cmd_launch->add_option("command", launch.command, "program and arguments, after --")->required();

  int demo_nproc = 2;
  int64_t demo_max_mib = 16;
  auto* cmd_demo = app.add_subcommand(
      "demo", "all-reduce check and bandwidth table across N local ranks (the main job)");
  cmd_demo->add_option("--nproc", demo_nproc, "ranks to start")->check(CLI::Range(1, 64));
  cmd_demo->add_option("--max-mib", demo_max_mib, "largest message, MiB")->check(CLI::Range(1, 1024));

  ShowOptions show;
  auto* cmd_schedule = app.add_subcommand("schedule", "pipeline schedules");
  cmd_schedule->require_subcommand(1);
  auto* cmd_show = cmd_schedule->add_subcommand(
      "show", "validate and simulate a schedule; print its timeline and bubble, write SVG and trace");
  auto* by_name = cmd_show->add_option("--schedule", show.schedule, "a registered schedule, e.g. 1F1B");
  auto* by_csv = cmd_show->add_option("--csv,--table", show.csv,
                                      "an action table: CSV (one row per rank) or JSON ({\"ranks\": [[...], ...]})");
  by_name->excludes(by_csv);
  cmd_show->add_option("--pp", show.pp, "pipeline ranks")->check(CLI::Range(1, 1024));
  cmd_show->add_option("--microbatches", show.microbatches, "microbatches per step")->check(CLI::Range(1, 100000));
  cmd_show->add_option("--stages-per-rank", show.stages_per_rank, "stages per rank")->check(CLI::Range(1, 64));
  cmd_show->add_option("--costs", show.costs, "costs of F,B,I,W (default 1,2,1,1)")->expected(4)->delimiter(',');
  cmd_show->add_option("--out", show.out, "prefix of the files written (default: schedule)");
  cmd_show->add_option("--max-outstanding-sends", show.max_outstanding_sends,
                       "sends in flight per rank, at most (0: unlimited)")->check(CLI::NonNegativeNumber);
  cmd_show->add_flag("--fsdp", show.fsdp, "stages are sharded: add UNSHARD, RESHARD and REDUCE_GRAD");

  std::string fr_dir;
  auto* cmd_fr = app.add_subcommand("fr", "flight records");
  cmd_fr->require_subcommand(1);
  auto* cmd_analyze = cmd_fr->add_subcommand("analyze", "name the rank and operation behind a hang or a mismatch");
  cmd_analyze->add_option("dir", fr_dir, "directory of rank*.json flight records")->required();

  CLI11_PARSE(app, argc, argv);
  try {
    if (cmd_launch->parsed()) {
      launch.master_port = static_cast<uint16_t>(master_port);
      launch.prefix_output = !no_prefix;
      return run_launch(launch);
    }
    if (cmd_analyze->parsed()) {
      bool found = false;
      std::cout << dist::analyze_flight_records(fr_dir, &found);
      return 0;
    }
    if (cmd_show->parsed()) {
      if (show.schedule.empty() && show.csv.empty())
        throw std::invalid_argument("schedule show: give --schedule NAME or --csv FILE");
      return schedule_show(show);
    }
    if (cmd_demo->parsed()) {
      if (dist::launched_by_launcher()) return demo_worker(demo_max_mib << 20);
      dist::LaunchOptions o;
      o.nproc = demo_nproc;
      o.command = {self_exe(), "demo", "--max-mib", std::to_string(demo_max_mib)};
      return run_launch(o);
    }
  } catch (const std::exception& e) {
    std::cerr << "fsdpp: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
