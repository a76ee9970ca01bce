// The executor with stages sharded by fully_shard over data-parallel ranks (dp x pp).
#include "pipeline/executor_fixture.hpp"

using namespace executor_test;

TEST_CASE("dp=2 x pp=2 with fully_shard stages matches unpipelined, unsharded training") {
  const int pp = 2, dp = 2, m = 4, rows = 4;  // each microbatch's 4 rows split over dp
  auto g = at::detail::createCPUGenerator(9);
  std::vector<at::Tensor> xs, ys;
  for (int i = 0; i < m; ++i)
    xs.push_back(at::randn({rows, kDim}, g)), ys.push_back(at::randn({rows, kDim}, g));
  // (schedule, stages per rank, max_active_stages, unshard lookahead): 1 stage active gathers a
  // rank's two stages in turn; lookahead 1 gathers each stage only when it is about to compute.
  for (const auto& [name, v, active, lookahead] :
       std::vector<std::tuple<std::string, int, int, std::string>>{{"GPipe", 1, 3, "full"},
                                                                   {"1F1B", 1, 3, "full"},
                                                                   {"Interleaved1F1B", 2, 3, "full"},
                                                                   {"Interleaved1F1B", 2, 1, "full"},
                                                                   {"Interleaved1F1B", 2, 3, "auto"},
                                                                   {"Interleaved1F1B", 2, 2, "1,1"},
                                                                   {"LoopedBFS", 2, 3, "full"},
                                                                   {"InterleavedZeroBubble", 1, 3, "full"},
                                                                   {"ZBVZeroBubble", 2, 3, "full"},
                                                                   {"ZBVZeroBubble", 2, 1, "full"},
                                                                   {"DualPipeV", 2, 3, "full"}}) {
    CAPTURE(active);
    CAPTURE(lookahead);
    const auto plan = make_plan(*make_schedule(name), {pp, v, m},
                                {.fsdp_stages = true,
                                 .max_outstanding_sends = 2,
                                 .max_active_stages = active,
                                 .unshard_lookahead = UnshardLookahead::parse(lookahead)});
    const int stages = pp * v;
    // Reference: 3 AdamW steps on the whole batch, one process, no sharding.
    Model ref(stages);
    std::vector<at::Tensor> all;
    for (auto& l : ref.layers)
      for (auto& p : l->parameters()) all.push_back(p);
    torch::optim::AdamW ropt(all, torch::optim::AdamWOptions(1e-2));
    std::vector<double> want_loss;
    for (int step = 0; step < 3; ++step) {
      ropt.zero_grad();
      auto h = at::cat(xs);
      for (int s = 0; s < stages; ++s) h = ref.stage(s, h);
      auto loss = at::mse_loss(h, at::cat(ys));
      loss.backward();
      ropt.step();
      want_loss.push_back(loss.item<double>());
    }
    test::run_ranks(pp * dp, [&](comm::Comm& world) {
      comm::DeviceMesh mesh(world, {{"pp", pp}, {"dp", dp}});
      const int d = mesh.coord("dp");
      Model model(stages);
      std::vector<fsdp::FullyShard<torch::nn::LinearImpl>> units;
      std::vector<PipelineStage> mine;
      std::vector<at::Tensor> sharded;
      units.reserve(stages);
      for (int s = 0; s < stages; ++s)
        if (plan.owner[s] == mesh.coord("pp")) {
          units.push_back(fsdp::fully_shard(model.layers[s].ptr(), mesh.comm("dp")));
          mine.push_back(sharded_stage(model, s, units.back()));
          for (auto& p : units.back()->sharded_parameters()) sharded.push_back(p);
        }
      PipelineExecutor exec(plan, mesh.comm("pp"), mine, mse, {{rows / dp, kDim}});
      const bool last = plan.owner[stages - 1] == mesh.coord("pp");
      const auto lx = dp_rows(xs, d, dp), ly = dp_rows(ys, d, dp);
      torch::optim::AdamW opt(sharded, torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        auto loss = at::full({1}, exec.step(lx, ly), at::kDouble);
        opt.step();
        mesh.comm("dp").all_reduce(loss, {comm::ReduceOp::kAvg}).wait();
        if (last) {
          INFO(name << " step " << step << " rank " << world.rank());
          CHECK(std::abs(loss.item<double>() - want_loss[step]) <= 1e-5 * want_loss[step]);
        }
      }
      for (auto& unit : units)
        for (const auto& [pname, full] : fsdp::full_state_dict(*unit.ptr())) {
          INFO(name << " " << pname);
          bool matched = false;  // find the stage whose layer this unit wraps
          for (int t = 0; t < stages; ++t)
            if (model.layers[t].ptr().get() == &unit->inner()) {
              CHECK(rel(full, ref.layers[t]->named_parameters()[pname]) < 1e-5);
              matched = true;
            }
          CHECK(matched);
        }
    });
  }
}

namespace {

// A stage of two blocks, each its own fully_shard unit under the stage's root.
struct TwoBlockStageImpl : torch::nn::Module {
  TwoBlockStageImpl() {
    a = register_module("a", fsdp::FullyShard<torch::nn::Linear>(torch::nn::Linear(kDim, kDim)));
    b = register_module("b", fsdp::FullyShard<torch::nn::Linear>(torch::nn::Linear(kDim, kDim)));
  }
  at::Tensor forward(at::Tensor x) { return b->forward(at::tanh(a->forward(x))); }
  fsdp::FullyShard<torch::nn::Linear> a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoBlockStage);

// This rank's TwoBlockStage of a dp x pp mesh, seeded per stage (weights seed + stage), sharded
// over the dp communicator, whose collectives `counter` counts.
struct ShardedTwoBlockStage {
  std::shared_ptr<test::CountingComm> counter;
  fsdp::FullyShard<TwoBlockStageImpl> stage{nullptr};
  std::vector<PipelineStage> mine;
  int s = 0, d = 0;
  ShardedTwoBlockStage(comm::DeviceMesh& mesh, uint64_t seed)
      : counter(std::make_shared<test::CountingComm>(mesh.comm("dp").impl_ptr())),
        s(mesh.coord("pp")),
        d(mesh.coord("dp")) {
    comm::Comm dp_comm(counter);
    dp_comm.set_consistency_check(false);
    TwoBlockStage module;
    {
      auto gen = at::detail::createCPUGenerator(seed + s);
      at::NoGradGuard no_grad;
      for (auto& p : module->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.5);
    }
    stage = fsdp::fully_shard(module, dp_comm);
    auto* root = stage.ptr().get();
    mine.push_back({s, [root](const at::Tensor& x) { return root->forward(x); }, root->parameters(),
                    fsdp_sharding(*root)});
  }
};

}  // namespace

TEST_CASE("FSDP stages stay gathered across their microbatches: one all-gather per unit per step") {
  // dp=2 x pp=2, 1F1B, 4 microbatches; each stage is a root (which owns no parameters) over two
  // units. Kept gathered from UNSHARD to RESHARD (the default), the 3 units are gathered once per
  // step; otherwise the two nested ones again for the microbatches' forwards and backwards. The
  // two units with parameters reduce-scatter once per step either way.
  const int pp = 2, dp = 2, m = 4, rows = 4;
  const auto plan = make_plan(*make_schedule("1F1B"), {pp, 1, m}, {.fsdp_stages = true});
  auto g = at::detail::createCPUGenerator(5);
  std::vector<at::Tensor> xs, ys;
  for (int i = 0; i < m; ++i)
    xs.push_back(at::randn({rows, kDim}, g)), ys.push_back(at::randn({rows, kDim}, g));
  std::map<bool, std::vector<double>> losses;
  for (bool keep : {true, false})
    test::run_ranks(pp * dp, [&](comm::Comm& world) {
      comm::DeviceMesh mesh(world, {{"pp", pp}, {"dp", dp}});
      ShardedTwoBlockStage rig(mesh, 100);  // the same weights for both runs, per stage
      const auto& counter = rig.counter;
      const int s = rig.s, d = rig.d;
      auto& stage = rig.stage;
      auto& mine = rig.mine;
      ExecutorOptions eo{.activation_shape = {rows / dp, kDim}, .keep_stages_unsharded = keep};
      PipelineExecutor exec(plan, mesh.comm("pp"), mine, mse, eo);
      const auto lx = dp_rows(xs, d, dp), ly = dp_rows(ys, d, dp);
      torch::optim::AdamW opt(stage->sharded_parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        counter->reset();
        opt.zero_grad();
        const double loss = exec.step(lx, ly);
        opt.step();
        INFO("keep=" << keep << " step " << step << " rank " << world.rank());
        const int gathers = counter->all_gathers;
        if (keep)
          CHECK(gathers == 3);
        else
          CHECK(gathers > 2 * m);
        CHECK(int(counter->reduce_scatters) == 2);
        if (step == 0 && world.rank() == 0)
          MESSAGE("all-gathers per step and rank, keep=" << keep << ": " << gathers);
        if (s == pp - 1 && d == 0) losses[keep].push_back(loss);
      }
    });
  // Where the parameters live between microbatches changes nothing in the arithmetic.
  CHECK(losses[true] == losses[false]);
  CHECK(losses[true].size() == 3);
}

// PyTorch 2.15's step(finalize_gradients=False): two calls of 4 microbatches before one optimizer
// step. Deferred, a sharded stage stays gathered across the calls and reduces once: per rank, the
// 3 units gathered once and the 2 with parameters reduce-scattered once per optimizer step, against
// twice each when every call finalizes; the gradients are the same sums.
TEST_CASE("gradients accumulated over schedule calls: FSDP stages stay gathered and reduce once, as 2.15's") {
  const int pp = 2, dp = 2, m = 4, rows = 4, calls = 2;
  const auto plan = make_plan(*make_schedule("1F1B"), {pp, 1, m}, {.fsdp_stages = true});
  auto g = at::detail::createCPUGenerator(7);
  std::vector<std::vector<at::Tensor>> xs(calls), ys(calls);
  for (int c = 0; c < calls; ++c)
    for (int i = 0; i < m; ++i)
      xs[c].push_back(at::randn({rows, kDim}, g)), ys[c].push_back(at::randn({rows, kDim}, g));
  std::mutex mu;
  std::map<std::pair<bool, int>, std::vector<at::Tensor>> grads;  // (deferred, rank) -> shard grads
  for (bool deferred : {true, false})
    test::run_ranks(pp * dp, [&](comm::Comm& world) {
      comm::DeviceMesh mesh(world, {{"pp", pp}, {"dp", dp}});
      ShardedTwoBlockStage rig(mesh, 200);
      const auto& counter = rig.counter;
      const int s = rig.s, d = rig.d;
      auto& stage = rig.stage;
      auto& mine = rig.mine;
      PipelineExecutor exec(plan, mesh.comm("pp"), mine, mse,
                            {.activation_shape = {rows / dp, kDim}, .loss_scale = 1.0 / (calls * m)});
      counter->reset();  // sharding checked its plan with collectives of its own
      for (int c = 0; c < calls; ++c)
        exec.step(dp_rows(xs[c], d, dp), dp_rows(ys[c], d, dp),
                  /*finalize_gradients=*/!deferred || c + 1 == calls);
      INFO("deferred=" << deferred << " rank " << world.rank());
      CHECK(int(counter->all_gathers) == (deferred ? 3 : 3 * calls));
      CHECK(int(counter->reduce_scatters) == (deferred ? 2 : 2 * calls));
      std::vector<at::Tensor> mine_grads;
      for (const auto& p : stage->sharded_parameters()) mine_grads.push_back(p.grad().clone());
      std::lock_guard<std::mutex> lock(mu);
      grads[{deferred, world.rank()}] = std::move(mine_grads);
    });
  for (int r = 0; r < pp * dp; ++r) {
    const auto &a = grads[{true, r}], &b = grads[{false, r}];
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) CHECK(rel(a[i], b[i]) < 1e-6);
  }
}
