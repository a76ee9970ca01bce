// The command line's smaller commands (tool_commands.hpp).
#include "tool_commands.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "fsdpp/base/blas.hpp"
#include "fsdpp/base/files.hpp"
#include "fsdpp/comm/init.hpp"
#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/table.hpp"
#include "fsdpp/pipeline/visualize.hpp"
#include "fsdpp/train/checkpoints.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/recipe.hpp"

namespace fsdpp::cli {

namespace {

// Where bundled recipes and configs live: FSDPP_HOME, next to the source tree of this build, the
// install prefix's share/fsdpp, or the working directory.
std::vector<std::filesystem::path> resource_roots() {
  namespace fs = std::filesystem;
  std::vector<fs::path> roots;
  if (const char* h = std::getenv("FSDPP_HOME")) roots.emplace_back(h);
  const fs::path exe_dir = fs::path(self_exe()).parent_path();
  for (const auto& p : {exe_dir / "..", exe_dir / ".." / "share" / "fsdpp", fs::current_path()})
    if (fs::is_directory(p / "recipes")) roots.push_back(fs::weakly_canonical(p));
  std::vector<fs::path> unique;
  for (const auto& r : roots)
    if (std::find(unique.begin(), unique.end(), r) == unique.end()) unique.push_back(r);
  return unique;
}

}  // namespace

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find the fsdpp executable (/proc/self/exe)");
  return std::string(buf, n);
}

// The demo job: every rank checks an all-reduce against its closed form, then rank 0 prints the
// all-reduce bandwidth table (nccl-tests convention: bus bandwidth = algbw * 2(n-1)/n).
int demo_worker(int64_t max_bytes) {
  auto comm = comm::init_from_env();
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
    std::cerr << fmt::format("rank {}: all_reduce gave {} instead of {}\n", rank, t[0].item<float>(),
                             expected);
    return 1;
  }
  if (rank == 0) {
    std::cout << fmt::format("all_reduce check: sum of (rank+1) over {} ranks = {} on every rank\n", n,
                             expected);
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
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters.item<int64_t>();
    if (rank == 0) {
      const double algbw = bytes / secs / 1e9;
      std::cout << fmt::format("{:>10} {:>6} {:>12.1f} {:>12.3f} {:>12.3f}\n", bytes, iters.item<int64_t>(),
                               secs * 1e6, algbw, algbw * 2.0 * (n - 1) / n);
    }
  }
  comm.barrier().wait();
  return 0;
}

int schedule_show(const ShowOptions& o) {
  using namespace fsdpp::pipeline;
  std::unique_ptr<Schedule> schedule;
  if (!o.csv.empty()) {
    schedule = load_table_schedule(o.csv);
  } else {
    schedule = make_schedule(o.schedule);
  }
  const int stages_per_rank = o.stages_per_rank.value_or(schedule->layout() == Layout::kV ? 2 : 1);
  const ScheduleSpec spec{.pp = o.pp, .stages_per_rank = stages_per_rank, .microbatches = o.microbatches};
  const auto plan = make_plan(*schedule, spec,
                              {.fsdp_stages = o.fsdp,
                               .max_outstanding_sends = o.max_outstanding_sends,
                               .max_active_stages = o.max_active_stages,
                               .unshard_lookahead = UnshardLookahead::parse(o.unshard_lookahead),
                               .defer_reduce_grad_wait = o.defer_reduce_grad_wait,
                               .defer_pp_recv = o.defer_pp_recv});
  const Costs costs{o.costs[0], o.costs[1], o.costs[2], o.costs[3], 0};
  const auto sim = simulate(plan.lowered, plan.owner, costs, o.max_outstanding_sends);
  const std::string title = fmt::format("{} pp={} stages/rank={} microbatches={}", schedule->name(), spec.pp,
                                        spec.stages_per_rank, spec.microbatches);
  std::cout << title << " (costs F=" << costs.forward << " B=" << costs.backward
            << " I=" << costs.backward_input << " W=" << costs.backward_weight << ")\n"
            << render_timeline(sim);
  for (size_t r = 0; r < plan.lowered.size(); ++r)
    std::cout << fmt::format(
        "rank {}: {} actions after lowering, peak live activations {}, peak "
        "receive buffers {}\n",
        r, plan.lowered[r].size(), sim.peak_activations[r], sim.peak_recv_buffers[r]);
  std::cout << fmt::format("mean bubble fraction {:.3f}, step time {} units\n", sim.mean_bubble(),
                           sim.makespan);
  if (o.out.empty()) return 0;
  write_file_atomically(o.out + ".svg", render_svg(sim, title));
  write_file_atomically(o.out + ".trace.json", chrome_trace(sim));
  std::ostringstream lowered, compute;
  write_csv(lowered, plan.lowered);
  // The compute actions alone: the format of PyTorch's _load_csv(format="compute_only").
  write_csv(compute, plan.compute);
  write_file_atomically(o.out + ".csv", lowered.str());
  write_file_atomically(o.out + ".compute.csv", compute.str());
  std::cout << "wrote " << o.out << ".svg, " << o.out << ".trace.json, " << o.out << ".csv (lowered) and "
            << o.out << ".compute.csv (compute actions, as PyTorch's compute_only CSV)\n";
  return 0;
}

int verify_checkpoints(std::string path) {
  namespace fs = std::filesystem;
  std::vector<std::string> dirs;
  // checkpoints/latest, the pointer the tree shows beside the checkpoints: the one it names.
  if (fs::is_regular_file(path)) {  // links followed; a FIFO is no pointer
    std::ifstream f(path);
    std::string name;
    std::getline(f, name);
    const auto target = fs::path(path).parent_path() / name;
    if (name.empty() || name.find('/') != std::string::npos || !fs::is_directory(target)) {
      std::cerr << fmt::format(
          "fsdpp ckpt verify: {} is a file, but not a pointer to a checkpoint beside it{}\n", path,
          name.empty() ? "" : fmt::format(" (it names '{}')", name));
      return kExitBadInput;
    }
    path = target.string();
  }
  if (fs::exists(fs::path(path) / "trainer.json") || fs::exists(fs::path(path) / "rank0.json"))
    dirs.push_back(path);
  else
    dirs = train::committed_checkpoints(path);
  if (dirs.empty()) {
    std::cerr << fmt::format("fsdpp ckpt verify: {} is neither a checkpoint nor a run directory with one\n",
                             path);
    return kExitBadInput;
  }
  int damaged = 0;
  for (const auto& dir : dirs) {
    try {
      const auto [files, bytes] = train::verify_checkpoint(dir);
      std::cout << fmt::format("{}: ok ({} files, {:.1f} MB, sizes and CRC-32C checked)\n", dir, files,
                               bytes / 1e6);
    } catch (const std::exception& e) {
      std::cout << fmt::format("{}: DAMAGED: {}\n", dir, e.what());
      ++damaged;
    }
  }
  return damaged ? 1 : 0;
}

int list_bundled() {
  namespace fs = std::filesystem;
  const auto roots = resource_roots();
  if (roots.empty()) {
    std::cout
        << "no recipes found (looked next to the fsdpp binary, in share/fsdpp and in the working directory; "
           "set FSDPP_HOME to the source tree)\n";
    return 1;
  }
  for (const char* kind : {"recipes", "configs"}) {
    std::cout << kind << ":\n";
    for (const auto& root : roots) {
      std::vector<fs::path> files;
      if (!fs::is_directory(root / kind)) continue;
      for (const auto& e : fs::directory_iterator(root / kind))
        if (e.path().extension() == ".json") files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (const auto& f : files) {
        std::string about;
        try {
          if (std::string(kind) == "recipes") {
            const auto r = train::load_recipe(f.string());
            about = r.resolved.value("description", "");
            about += fmt::format("{}dp {} x pp {}, {} steps", about.empty() ? "" : "; ", r.parallel.dp,
                                 r.parallel.pp, r.train.steps);
          } else {
            const auto c = train::parse_model_config(read_json_file(f.string()), f.string());
            about = fmt::format("{:.2f}M parameters, {} layers, dim {}, {} experts top-{}",
                                c.parameter_count() / 1e6, c.layers, c.dim, c.experts, c.top_k);
          }
        } catch (const std::exception& e) {
          about = fmt::format("INVALID: {}", e.what());
        }
        std::cout << fmt::format("  {:<44} {}\n", fs::relative(f, fs::current_path()).string(), about);
      }
    }
  }
  return 0;
}

}  // namespace fsdpp::cli
