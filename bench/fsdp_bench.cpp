// fully_shard benchmarks; each mode prints one result line (rank 0 only under the launcher).
//   throughput --sharded|--unsharded [--threads N] [--no-overlap] [--no-reshard] [--steps S] [--batch B]
//       tokens/s of bench/transformer.hpp training with AdamW; B is the global batch (sequences).
//       --sharded runs under `fsdpp launch`, each of the dp ranks taking B/dp sequences.
//   memory        per-rank bytes of parameters, gradients and AdamW state after one step
//   unit-cost     microseconds of framework bookkeeping per unit per step, 200 tiny units, 1 rank
//                 [--rounds R] pairs of rounds (plain, sharded; --steps steps each) to take the
//                 median difference over (25)
//                 [--only plain|sharded] one side alone, for a profiler
//                 [--only ops] the ATen operators a sharded step adds per unit, by name
//   adamw         milliseconds per optimizer step on the parameters of configs/moe-small.json's model:
//                 fsdp::AdamW (ATen's fused CPU kernel), fsdp::AdamW with fused=false (the tensor
//                 expression), LibTorch's torch::optim::AdamW; [--threads N] [--rounds R] rounds of
//                 [--steps S] steps of each, in rotating order; medians over rounds
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <ctime>
#include <vector>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/base/blas.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/recipe.hpp"
#include "transformer.hpp"

using namespace fsdpp;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string mode;
  bool sharded = false, overlap = true, reshard = true;
  std::string only;  // unit-cost: "plain" or "sharded" runs just that side; "ops" counts operators
  int threads = 1, steps = 20, rounds = 25;
  int64_t batch = 16;
};

Args parse(int argc, char** argv) {
  Args a;
  a.mode = argc > 1 ? argv[1] : "";
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atoll(argv[++i]) : 0; };
    if (s == "--sharded")
      a.sharded = true;
    else if (s == "--unsharded")
      a.sharded = false;
    else if (s == "--no-overlap")
      a.overlap = false;
    else if (s == "--no-reshard")
      a.reshard = false;
    else if (s == "--only" && i + 1 < argc) {
      a.only = argv[++i];
      if (a.only != "plain" && a.only != "sharded" && a.only != "ops")
        throw std::invalid_argument("fsdp_bench: --only takes plain, sharded or ops, not " + a.only);
    } else if (s == "--threads")
      a.threads = static_cast<int>(next());
    else if (s == "--steps")
      a.steps = static_cast<int>(next());
    else if (s == "--rounds")
      a.rounds = std::max(1, static_cast<int>(next()));
    else if (s == "--batch")
      a.batch = next();
    else
      throw std::invalid_argument("fsdp_bench: unknown argument " + s);
  }
  return a;
}

at::Tensor tokens(int64_t batch, int64_t seq, int64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return at::randint(256, {batch, seq + 1}, g);
}

int throughput(const Args& a) {
  at::set_num_threads(a.threads);
  bench::TransformerConfig cfg;
  auto net = bench::Transformer(cfg);
  comm::Comm comm;
  int rank = 0, dp = 1;
  std::optional<fsdp::FullyShard<bench::TransformerImpl>> model;
  std::vector<at::Tensor> params = net->parameters();
  if (a.sharded) {
    comm = comm::init_from_env();
    rank = comm.rank();
    dp = comm.size();
    fsdp::FullyShardOptions o;
    o.overlap_reduce_scatter = a.overlap;
    o.reshard_after_forward = a.reshard;
    model = fsdp::fully_shard(net, comm, o);
    params = (*model)->sharded_parameters();
  }
  if (rank == 0) std::cout << describe(probe_blas()) << std::endl;
  const int64_t local = a.batch / dp;
  auto data = tokens(a.batch, cfg.seq, 1).narrow(0, rank * local, local);
  auto x = data.narrow(1, 0, cfg.seq), y = data.narrow(1, 1, cfg.seq);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
  auto step = [&] {
    opt.zero_grad();
    auto logits = model ? (*model)->forward(x) : net->forward(x);
    at::cross_entropy_loss(logits.reshape({-1, cfg.vocab}), y.reshape(-1)).backward();
    opt.step();
  };
  for (int i = 0; i < 3; ++i) step();
  if (a.sharded) comm.barrier().wait();
  const auto t0 = Clock::now();
  for (int i = 0; i < a.steps; ++i) step();
  if (a.sharded) comm.barrier().wait();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  if (rank == 0)
    std::cout << fmt::format(
        "RESULT throughput {} dp={} threads/rank={} overlap={} reshard_after_forward={} "
        "tokens/s={:.0f} step_ms={:.1f}\n",
        a.sharded ? "fsdpp" : "unsharded", dp, a.threads, a.overlap, a.reshard,
        a.batch * cfg.seq * a.steps / secs, secs / a.steps * 1e3);
  return 0;
}

int memory(const Args&) {
  at::set_num_threads(1);
  bench::TransformerConfig cfg;
  auto comm = comm::init_from_env();
  auto model = fsdp::fully_shard(bench::Transformer(cfg), comm);
  torch::optim::AdamW opt(model->sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  auto data = tokens(2 * comm.size(), cfg.seq, 1).narrow(0, comm.rank() * 2, 2);
  at::cross_entropy_loss(model->forward(data.narrow(1, 0, cfg.seq)).reshape({-1, cfg.vocab}),
                         data.narrow(1, 1, cfg.seq).reshape(-1))
      .backward();
  opt.step();
  // This rank's bytes: sharded parameters, their gradients and AdamW's two moments.
  int64_t mine = 0, total = 0, largest_unit = 0;
  for (fsdp::Unit* u : model->fsdp_unit().tree_units()) {
    int64_t unit_bytes = 0;
    for (const auto& info : u->group().shard_infos()) {
      int64_t numel = 1;
      for (auto d : info.global_shape) numel *= d;
      total += 4 * numel * 4;  // fp32 parameter + gradient + 2 moments
      unit_bytes += numel * at::elementSize(info.compute_dtype);
    }
    largest_unit = std::max(largest_unit, unit_bytes);
  }
  for (const auto& p : model->sharded_parameters()) {
    mine += p.nbytes() + (p.grad().defined() ? p.grad().nbytes() : 0);
  }
  for (auto& kv : opt.state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*kv.second);
    mine += st.exp_avg().nbytes() + st.exp_avg_sq().nbytes();
  }
  auto t = at::full({1}, static_cast<double>(mine), at::kDouble);
  comm.all_reduce(t, {comm::ReduceOp::kMax}).wait();
  if (comm.rank() == 0) {
    const double ideal = static_cast<double>(total) / comm.size();
    std::cout << fmt::format(
        "RESULT memory dp={} max_rank_bytes={:.0f} total_unsharded_bytes={} ideal={:.0f} "
        "ratio={:.3f} bound={:.0f} largest_unit_unsharded_bytes={}\n",
        comm.size(), t.item<double>(), total, ideal, t.item<double>() / ideal,
        1.05 * ideal + 2 * largest_unit, largest_unit);
  }
  return 0;
}

struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 200; ++i)
      layers->push_back(fsdp::FullyShard<torch::nn::Linear>(torch::nn::Linear(8, 8)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& l : *layers) x = l->as<fsdp::FullyShardImpl<torch::nn::Linear>>()->forward(x);
    return x;
  }
  torch::nn::ModuleList layers{nullptr};
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Where the operator-counting callback adds, by operator name (unit-cost --only ops).
thread_local std::map<std::string, int64_t>* t_op_counts = nullptr;

int unit_cost(const Args& a) {
  at::set_num_threads(1);
  auto comm = comm::init_from_env();
  auto x = at::randn({4, 8});
  auto plain = std::make_shared<TinyImpl>();
  auto model = fsdp::fully_shard(std::make_shared<TinyImpl>(), comm);
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-4));
  torch::optim::AdamW sharded_opt(model->sharded_parameters(), torch::optim::AdamWOptions(1e-4));
  auto plain_step = [&] {
    plain_opt.zero_grad();
    plain->forward(x).sum().backward();
    plain_opt.step();
  };
  auto sharded_step = [&] {
    sharded_opt.zero_grad();
    model->forward(x).sum().backward();
    sharded_opt.step();
  };
  auto round = [&](auto& step) {
    const auto t0 = Clock::now();
    for (int i = 0; i < a.steps; ++i) step();
    return std::chrono::duration<double>(Clock::now() - t0).count() / a.steps;
  };
  for (int i = 0; i < 3; ++i) plain_step(), sharded_step();
  if (a.only == "ops") {  // ATen operators per step, the sharded side's extra ones by name
    std::map<std::string, int64_t> counts[2];
    auto handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          ++(*t_op_counts)[fn.name()];
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    for (int side = 0; side < 2; ++side) {
      t_op_counts = &counts[side];
      for (int i = 0; i < a.steps; ++i) side == 0 ? plain_step() : sharded_step();
    }
    at::removeCallback(handle);
    std::vector<std::pair<double, std::string>> extra;
    double total = 0;
    for (const auto& [name, n] : counts[0]) counts[1][name];  // every name on both sides
    for (const auto& [name, n] : counts[1]) {
      const double d = double(n - counts[0][name]) / a.steps / 200;
      total += d;
      if (d != 0) extra.emplace_back(d, name);
    }
    std::sort(extra.rbegin(), extra.rend());
    std::cout << fmt::format("RESULT unit-cost-ops extra_ops_per_unit_per_step={:.2f}\n", total);
    for (const auto& [d, name] : extra) std::cout << fmt::format("  {:7.2f} {}\n", d, name);
    return 0;
  }
  if (!a.only.empty()) {  // one side alone, for perf: `perf record ... unit-cost --only sharded`
    const double t = a.only == "plain" ? round(plain_step) : round(sharded_step);
    if (comm.rank() == 0) std::cout << fmt::format("RESULT unit-cost-{} step_us={:.0f}\n", a.only, t * 1e6);
    return 0;
  }
  // Pairs of rounds, one of each side, in alternating order; the cost is the median over pairs
  // of the difference within a pair, so that a busy spell of the machine, which slows the two
  // rounds of a pair alike, cancels. Wall-clock time, and the thread's CPU time beside it (which
  // leaves out time the thread was not running). A shared machine's neighbours also slow the
  // thread while it runs, by up to 2x, which no pairing removes: the fastest round of each side
  // (min_us_per_unit_per_step, from many short rounds) is the least disturbed estimate.
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  };
  auto timed = [&](auto& step) {
    const double c0 = cpu_now();
    const double wall = round(step);
    return std::pair<double, double>{wall, (cpu_now() - c0) / a.steps};
  };
  std::vector<double> tp, ts, d_wall, d_cpu;
  for (int r = 0; r < a.rounds; ++r) {
    std::pair<double, double> p, s;
    if (r % 2 == 0)
      p = timed(plain_step), s = timed(sharded_step);
    else
      s = timed(sharded_step), p = timed(plain_step);
    tp.push_back(p.first);
    ts.push_back(s.first);
    d_wall.push_back((s.first - p.first) / 200);
    d_cpu.push_back((s.second - p.second) / 200);
  }
  if (comm.rank() == 0)
    std::cout << fmt::format(
        "RESULT unit-cost units=200 world={} rounds={} plain_step_us={:.0f} sharded_step_us={:.0f} "
        "us_per_unit_per_step={:.1f} cpu_us_per_unit_per_step={:.1f} min_us_per_unit_per_step={:.1f}\n",
        comm.size(), a.rounds, median(tp) * 1e6, median(ts) * 1e6, median(d_wall) * 1e6, median(d_cpu) * 1e6,
        (*std::min_element(ts.begin(), ts.end()) - *std::min_element(tp.begin(), tp.end())) / 200 * 1e6);
  return 0;
}

// The optimizer alone, on the default model's parameters with fixed gradients: the three updates
// timed in turn, the same number of steps each per round.
int adamw(const Args& a) {
  at::set_num_threads(a.threads);
  const std::string path = "configs/moe-small.json";
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error("fsdp_bench adamw: cannot read " + path + " (run from the repository root)");
  const auto cfg = train::parse_model_config(nlohmann::json::parse(in), path);
  at::manual_seed(0);
  models::MoETransformer net(cfg);
  // Three copies of the parameters, matrices decayed, vectors not, as the trainer splits them.
  struct Side {
    std::vector<at::Tensor> decay, no_decay;
  };
  Side sides[3];
  int64_t numel = 0;
  for (const auto& p : net->parameters()) {
    numel += p.numel();
    const auto g = at::randn_like(p) * 1e-2;
    for (auto& s : sides) {
      auto c = p.detach().clone().requires_grad_();
      c.mutable_grad() = g.clone();
      (p.dim() >= 2 ? s.decay : s.no_decay).push_back(c);
    }
  }
  fsdp::AdamWOptions o{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  fsdp::AdamW fused(sides[0].decay, o, sides[0].no_decay);
  o.fused = false;
  fsdp::AdamW expression(sides[1].decay, o, sides[1].no_decay);
  auto lo = torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(sides[2].decay, std::make_unique<torch::optim::AdamWOptions>(lo));
  auto nd = std::make_unique<torch::optim::AdamWOptions>(lo);
  nd->weight_decay(0);
  groups.emplace_back(sides[2].no_decay, std::move(nd));
  torch::optim::AdamW libtorch(std::move(groups), lo);
  const std::function<void()> steps[3] = {[&] { fused.step(); }, [&] { expression.step(); },
                                          [&] { libtorch.step(); }};
  for (auto& s : steps) s();  // state allocated, pages touched
  std::vector<double> ms[3];
  for (int r = 0; r < a.rounds; ++r)
    for (int k = 0; k < 3; ++k) {
      const int side = (r + k) % 3;
      const auto t0 = Clock::now();
      for (int i = 0; i < a.steps; ++i) steps[side]();
      ms[side].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / a.steps);
    }
  std::cout << fmt::format(
      "RESULT adamw params={} tensors={} threads={} rounds={} steps={} fused_ms={:.2f} "
      "expression_ms={:.2f} libtorch_ms={:.2f}\n",
      numel, sides[0].decay.size() + sides[0].no_decay.size(), a.threads, a.rounds, a.steps, median(ms[0]),
      median(ms[1]), median(ms[2]));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto a = parse(argc, argv);
    if (a.mode == "throughput") return throughput(a);
    if (a.mode == "memory") return memory(a);
    if (a.mode == "unit-cost") return unit_cost(a);
    if (a.mode == "adamw") return adamw(a);
    std::cerr << "usage: fsdpp_fsdp_bench throughput|memory|unit-cost|adamw [options]\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdp_bench: " << e.what() << "\n";
    return 1;
  }
}
