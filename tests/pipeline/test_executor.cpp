// The executor runs every built-in schedule on real stages over Gloo and gives the gradients of
// the unpipelined model.
#include <torch/nn/modules/linear.h>

#include <fstream>
#include <tuple>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <torch/optim/adamw.h>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/comm/mesh.hpp"
#include "comm/ranks.hpp"
#include "fsdp/event_log.hpp"
#include "fsdpp/pipeline/executor.hpp"
#include "fsdpp/pipeline/fsdp_stage.hpp"
#include "fsdpp/pipeline/table.hpp"

using namespace fsdpp;
using namespace fsdpp::pipeline;

namespace {

constexpr int64_t kDim = 6, kMicro = 3;  // rows per microbatch

// One Linear + tanh per stage (the last without tanh); the reference runs them in sequence.
struct Model {
  std::vector<torch::nn::Linear> layers;
  explicit Model(int stages) {
    auto g = at::detail::createCPUGenerator(17);
    for (int s = 0; s < stages; ++s) {
      layers.emplace_back(kDim, kDim);
      at::NoGradGuard no_grad;
      for (auto& p : layers.back()->parameters()) p.copy_(at::randn(p.sizes(), g) * 0.5);
    }
  }
  at::Tensor stage(int s, const at::Tensor& x) {
    auto y = layers[s]->forward(x);
    return s + 1 < static_cast<int>(layers.size()) ? at::tanh(y) : y;
  }
};

// Data-parallel rank d's rows of each microbatch (rows split evenly over dp ranks).
std::vector<at::Tensor> dp_rows(const std::vector<at::Tensor>& microbatches, int d, int dp) {
  std::vector<at::Tensor> out;
  for (const auto& b : microbatches) out.push_back(b.narrow(0, d * b.size(0) / dp, b.size(0) / dp));
  return out;
}

struct Batch {
  std::vector<at::Tensor> x, y;
};

Batch make_batch(int m) {
  auto g = at::detail::createCPUGenerator(5);
  Batch b;
  for (int i = 0; i < m; ++i)
    b.x.push_back(at::randn({kMicro, kDim}, g)), b.y.push_back(at::randn({kMicro, kDim}, g));
  return b;
}

// Gradients of the mean loss over the whole batch, without pipelining.
std::vector<std::vector<at::Tensor>> reference_grads(int stages, int m) {
  Model ref(stages);
  const auto b = make_batch(m);
  auto h = at::cat(b.x);
  for (int s = 0; s < stages; ++s) h = ref.stage(s, h);
  at::mse_loss(h, at::cat(b.y)).backward();
  std::vector<std::vector<at::Tensor>> out;
  for (auto& l : ref.layers) out.push_back({l->weight.grad().clone(), l->bias.grad().clone()});
  return out;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / (b.norm().item<double>() + 1e-30);
}

// The tests' loss.
at::Tensor mse(const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); }

// The stages of `model` that `plan` puts on `rank`, unsharded.
std::vector<PipelineStage> plain_stages(const Plan& plan, Model& model, int rank) {
  std::vector<PipelineStage> mine;
  for (int s = 0; s < plan.spec.num_stages(); ++s)
    if (plan.owner[size_t(s)] == rank)
      mine.push_back(
          {s, [&model, s](const at::Tensor& x) { return model.stage(s, x); }, model.layers[s]->parameters()});
  return mine;
}

}  // namespace

namespace {

// 5 AdamW steps of the unpipelined model on the whole batch: its parameters afterwards.
std::vector<std::vector<at::Tensor>> reference_params(int stages, int m) {
  Model ref(stages);
  std::vector<at::Tensor> all;
  for (auto& l : ref.layers)
    for (auto& p : l->parameters()) all.push_back(p);
  torch::optim::AdamW opt(all, torch::optim::AdamWOptions(1e-2));
  const auto b = make_batch(m);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto h = at::cat(b.x);
    for (int s = 0; s < stages; ++s) h = ref.stage(s, h);
    at::mse_loss(h, at::cat(b.y)).backward();
    opt.step();
  }
  std::vector<std::vector<at::Tensor>> out;
  for (auto& l : ref.layers) out.push_back({l->weight.detach().clone(), l->bias.detach().clone()});
  return out;
}

// Runs `plan` on threads over Gloo: checks the first step's gradients against `grads`, then the
// parameters after 5 AdamW steps against `params`, and the executor's buffer counters.
void check_pipelined(const Plan& plan, const std::vector<std::vector<at::Tensor>>& grads,
                     const std::vector<std::vector<at::Tensor>>& params, const std::string& what) {
  const int stages = plan.spec.num_stages(), m = plan.spec.microbatches;
  test::run_ranks(plan.spec.pp, [&](comm::Comm& comm) {
    Model model(stages);
    std::vector<PipelineStage> mine;
    std::vector<at::Tensor> mine_params;
    for (int s = 0; s < stages; ++s)
      if (plan.owner[s] == comm.rank()) {
        mine.push_back({s, [&model, s](const at::Tensor& x) { return model.stage(s, x); },
                        model.layers[s]->parameters()});
        for (auto& p : model.layers[s]->parameters()) mine_params.push_back(p);
      }
    PipelineExecutor exec(plan, comm, mine, mse, {{kMicro, kDim}});
    torch::optim::AdamW opt(mine_params, torch::optim::AdamWOptions(1e-2));
    const auto b = make_batch(m);
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      exec.step(b.x, b.y);
      if (step == 0)
        for (const auto& st : mine) {
          INFO(what << " stage " << st.index << " gradients");
          CHECK(rel(model.layers[st.index]->weight.grad(), grads[st.index][0]) < 1e-5);
          CHECK(rel(model.layers[st.index]->bias.grad(), grads[st.index][1]) < 1e-5);
        }
      opt.step();
    }
    for (const auto& st : mine) {
      INFO(what << " stage " << st.index << " after 5 AdamW steps");
      CHECK(rel(model.layers[st.index]->weight, params[st.index][0]) < 1e-5);
      CHECK(rel(model.layers[st.index]->bias, params[st.index][1]) < 1e-5);
    }
    // Receive buffers: one allocated per RECV action when it runs, never more live than simulated.
    int recvs = 0;
    for (const auto& a : plan.lowered[comm.rank()])
      recvs += a.type == ActionType::kRecvF || a.type == ActionType::kRecvB;
    CHECK(exec.stats().recv_buffers_allocated == 5 * recvs);
    int send_f = 0;
    for (const auto& a : plan.lowered[comm.rank()]) send_f += a.type == ActionType::kSendF;
    CHECK(exec.stats().outputs_released == 5 * send_f);
    CHECK(exec.stats().peak_recv_buffers <=
          simulate(plan.lowered, plan.owner).peak_recv_buffers[comm.rank()]);
  });
}

}  // namespace

TEST_CASE("every built-in schedule trains like the unpipelined model (pp 2 and 4)") {
  struct Case {
    std::string name;
    int v;
  };
  for (const auto& c : std::vector<Case>{{"GPipe", 1},
                                         {"1F1B", 1},
                                         {"LoopedBFS", 2},
                                         {"Interleaved1F1B", 2},
                                         {"InterleavedZeroBubble", 1},
                                         {"ZBVZeroBubble", 2},
                                         {"DualPipeV", 2}})
    for (int pp : {2, 4})
      for (int m : {pp, 2 * pp, 2 * pp + 1}) {
        auto schedule = make_schedule(c.name);
        const ScheduleSpec spec{pp, c.v, m};
        try {
          schedule->check(spec);
        } catch (const ScheduleError&) {
          continue;  // e.g. interleaved schedules refuse some microbatch counts (tested elsewhere)
        }
        check_pipelined(make_plan(*schedule, spec), reference_grads(spec.num_stages(), m),
                        reference_params(spec.num_stages(), m),
                        c.name + " pp=" + std::to_string(pp) + " m=" + std::to_string(m));
        // Each receive right before its use.
        if (m == 2 * pp)
          check_pipelined(
              make_plan(*schedule, spec, {.defer_pp_recv = true}), reference_grads(spec.num_stages(), m),
              reference_params(spec.num_stages(), m),
              c.name + " pp=" + std::to_string(pp) + " m=" + std::to_string(m) + " defer_pp_recv=true");
      }
}

TEST_CASE(
    "forward only: the plan's forwards give the unpipelined losses, keep nothing, and training goes on "
    "after") {
  // Every built-in at pp 2 and 4 under a send budget of 1, for 1 and for all m microbatches.
  int checked = 0;
  for (const auto& name : schedule_names())
    for (int pp : {2, 4})
      for (int v : {1, 2}) {
        const int m = 2 * pp;
        const auto s = make_schedule(name);
        const ScheduleSpec spec{.pp = pp, .stages_per_rank = v, .microbatches = m};
        try {
          s->check(spec);
        } catch (const ScheduleError&) {
          continue;
        }
        const auto plan = make_plan(*s, spec, {.fsdp_stages = true, .max_outstanding_sends = 1});
        const int stages = spec.num_stages();
        const auto b = make_batch(m);
        // The unpipelined losses of each microbatch.
        std::vector<double> want;
        {
          Model ref(stages);
          at::NoGradGuard no_grad;
          for (int i = 0; i < m; ++i) {
            auto h = b.x[i];
            for (int st = 0; st < stages; ++st) h = ref.stage(st, h);
            want.push_back(at::mse_loss(h, b.y[i]).item<double>());
          }
        }
        const auto grads = reference_grads(stages, m);
        ++checked;
        test::run_ranks(pp, [&](comm::Comm& comm) {
          Model model(stages);
          std::vector<PipelineStage> mine;
          for (int st = 0; st < stages; ++st)
            if (plan.owner[st] == comm.rank())
              mine.push_back({st, [&model, st](const at::Tensor& x) { return model.stage(st, x); },
                              model.layers[st]->parameters()});
          PipelineExecutor exec(plan, comm, mine, mse, {.activation_shape = {kMicro, kDim}});
          const bool last = plan.owner[stages - 1] == comm.rank();
          INFO(name << " pp=" << pp << " v=" << v << " rank " << comm.rank());
          for (int count : {1, m}) {
            const std::vector<at::Tensor> xs(b.x.begin(), b.x.begin() + count),
                ys(b.y.begin(), b.y.begin() + count);
            const auto got = exec.forward(xs, ys);
            CHECK_FALSE(got.requires_grad());
            double sum = 0;
            for (int i = 0; i < count; ++i) sum += want[i];
            CHECK(got.item<double>() == doctest::Approx(last ? sum : 0.0).epsilon(1e-6));
          }
          for (const auto& st : mine) CHECK_FALSE(model.layers[st.index]->weight.grad().defined());
          exec.step(b.x, b.y);
          for (const auto& st : mine)
            CHECK(rel(model.layers[st.index]->weight.grad(), grads[st.index][0]) < 1e-5);
          CHECK(test::error_of([&] { exec.forward({}, {}); }).find("forward takes 1 to") !=
                std::string::npos);
        });
      }
  CHECK(checked >= 8);
}

TEST_CASE(
    "under a send budget some receives must be posted earlier: without that the plan deadlocks, with it it "
    "runs") {
  // Every built-in at budget 1: where make_plan had to hoist receives, the plain lowering (each
  // receive before its use, in peer send order) deadlocks in the simulator; the hoisted plan runs
  // on real ranks and trains like the unpipelined model.
  int needed = 0, ran = 0;
  for (const auto& name : schedule_names())
    for (int pp : {2, 4})
      for (int v : {1, 2})
        for (int m : {pp, 2 * pp}) {
          const auto s = make_schedule(name);
          const ScheduleSpec spec{pp, v, m};
          try {
            s->check(spec);
          } catch (const ScheduleError&) {
            continue;
          }
          const auto plan = make_plan(*s, spec, {.max_outstanding_sends = 1, .defer_pp_recv = true});
          auto plain = add_send_recv(plan.compute, plan.owner);
          order_receives(plain, plan.owner);
          plain = add_send_waits(plain);
          if (plain == plan.lowered) continue;
          ++needed;
          INFO(name << " pp=" << pp << " v=" << v << " m=" << m);
          CHECK(test::error_of([&] { simulate(plain, plan.owner, {}, 1); }).find("the schedule deadlocks") !=
                std::string::npos);
          if (ran < 2) {
            ++ran;
            check_pipelined(plan, reference_grads(spec.num_stages(), m),
                            reference_params(spec.num_stages(), m), name + " budget 1");
          }
        }
  MESSAGE(needed << " (schedule, pp, v, m) plans needed hoisted receives at budget 1");
  CHECK(needed > 0);
}

TEST_CASE(
    "a forward output's storage is given up once its send is issued, and is not while the stage's backward "
    "needs it") {
  // The stages keep a handle on every output they return; the bytes behind those handles are what
  // the executor still holds. Outputs that were sent (not the last stage's) hold none right after
  // their step's forward; the last stage's, which the loss needs, keep theirs.
  const ScheduleSpec spec{2, 1, 4};
  const auto plan = make_plan(*make_schedule("1F1B"), spec);
  test::run_ranks(2, [&](comm::Comm& comm) {
    Model model(2);
    const int s = comm.rank();
    std::vector<at::Tensor> outputs;
    std::vector<PipelineStage> mine{{s,
                                     [&](const at::Tensor& x) {
                                       auto y = model.stage(s, x);
                                       outputs.push_back(y);
                                       return y;
                                     },
                                     model.layers[s]->parameters()}};
    PipelineExecutor exec(plan, comm, mine, mse, {{kMicro, kDim}});
    const auto b = make_batch(spec.microbatches);
    exec.step(b.x, b.y);
    REQUIRE(outputs.size() == 4);
    for (const auto& y : outputs) {
      INFO("stage " << s);
      if (s == 0)
        CHECK(y.storage().nbytes() == 0);  // sent: released
      else
        CHECK(y.storage().nbytes() == size_t(kMicro * kDim) * sizeof(float));  // the loss's input
    }
  });
}

TEST_CASE(
    "each directed edge's traffic goes over its own two-rank communicator, one way, and nothing over the "
    "pipeline's") {
  // Interleaved1F1B at pp 4, 2 stages per rank: rank 3 sends forward to rank 0 (stage 3 -> 4) as
  // well as to its neighbours, so 8 directed edges. The flight records of the step say which
  // communicator carried each send and receive.
  const ScheduleSpec spec{4, 2, 8};
  const auto plan = make_plan(*make_schedule("Interleaved1F1B"), spec);
  std::map<std::pair<int, int>, int> want;  // (from rank, to rank) -> sends in the plan
  for (int r = 0; r < spec.pp; ++r)
    for (const auto& a : plan.lowered[size_t(r)]) {
      if (a.type == ActionType::kSendF) ++want[{r, plan.owner[size_t(a.stage + 1)]}];
      if (a.type == ActionType::kSendB) ++want[{r, plan.owner[size_t(a.stage - 1)]}];
    }
  REQUIRE(want.size() == 8);
  test::run_ranks(spec.pp, [&](comm::Comm& comm) {
    Model model(spec.num_stages());
    auto mine = plain_stages(plan, model, comm.rank());
    PipelineExecutor exec(plan, comm, mine, mse, {{kMicro, kDim}});
    const auto b = make_batch(spec.microbatches);
    exec.step(b.x, b.y);
    comm.barrier().wait();
    if (comm.rank() == 0) {
      // Every rank's communicators live in this process: group their records by communicator.
      std::map<std::string, std::map<int, std::vector<std::string>>> ops;  // comm -> its rank -> ops
      std::map<std::string, int> sizes;
      for (const auto& rec : nlohmann::json::parse(comm::flight_records_json())) {
        sizes[rec["comm"]] = rec["size"];
        auto& mine_ops = ops[rec["comm"]][rec["rank"].get<int>()];
        for (const auto& e : rec["entries"]) mine_ops.push_back(e["op"]);
      }
      std::multiset<int> got_sends, want_sends;
      for (const auto& [edge, n] : want) want_sends.insert(n);
      for (const auto& [name, by_rank] : ops) {
        CAPTURE(name);
        int sends = 0, recvs = 0;
        for (const auto& [rank, list] : by_rank)
          for (const auto& op : list) {
            if (op != "send" && op != "recv") continue;
            CHECK(sizes[name] == 2);                     // p2p only on two-rank communicators
            CHECK(op == (rank == 0 ? "send" : "recv"));  // and one way: the sender is rank 0
            (op == "send" ? sends : recvs) += 1;
          }
        CHECK(sends == recvs);
        if (sends > 0) got_sends.insert(sends);
      }
      CHECK(got_sends == want_sends);  // one communicator per edge, carrying that edge's sends
    }
    comm.barrier().wait();
  });
}

TEST_CASE(
    "a stage's REDUCE_GRAD overlaps the rank's other stage's backward; its WAIT_REDUCE_GRAD, right after it, "
    "does not") {
  // dp=2 x pp=2, Interleaved1F1B, 2 stages per rank, 4 microbatches: pipeline rank 0 holds stages
  // 0 and 2. Stage 2's backwards finish first; its reduce-scatter must go out before stage 0's
  // last weight gradient is computed, not at the end of the step. With every reduce-scatter slowed
  // by 100 ms: deferred waits let stage 0 compute while stage 2's is in flight; waits right after
  // (the default, PyTorch 2.15's) never do.
  const int pp = 2, dp = 2, v = 2, m = 4, rows = 4, stages = pp * v;
  for (const bool defer : {true, false}) {
    const auto plan = make_plan(*make_schedule("Interleaved1F1B"), {pp, v, m},
                                {.fsdp_stages = true, .defer_reduce_grad_wait = defer});
    auto g = at::detail::createCPUGenerator(3);
    std::vector<at::Tensor> xs, ys;
    for (int i = 0; i < m; ++i)
      xs.push_back(at::randn({rows, kDim}, g)), ys.push_back(at::randn({rows, kDim}, g));
    test::run_ranks(pp * dp, [&](comm::Comm& world) {
      comm::DeviceMesh mesh(world, {{"pp", pp}, {"dp", dp}});
      const int d = mesh.coord("dp");
      test::EventLog log;
      Model model(stages);
      std::vector<fsdp::FullyShard<torch::nn::LinearImpl>> units;
      units.reserve(stages);
      std::vector<PipelineStage> mine;
      for (int s = 0; s < stages; ++s) {
        if (plan.owner[s] != mesh.coord("pp")) continue;
        comm::Comm comm(std::make_shared<test::DelayingComm>(mesh.comm("dp").impl_ptr(), log,
                                                             std::chrono::milliseconds(100),
                                                             "stage" + std::to_string(s) + " "));
        comm.set_consistency_check(false);
        units.push_back(fsdp::fully_shard(model.layers[s].ptr(), comm));
        model.layers[s]->weight.register_hook([&log, s](const at::Tensor& grad) {
          log.add("wgrad " + std::to_string(s));
          return grad;
        });
        auto* unit = units.back().ptr().get();
        const bool last = s == stages - 1;
        mine.push_back({s,
                        [unit, last](const at::Tensor& x) {
                          auto y = unit->forward(x);
                          return last ? y : at::tanh(y);
                        },
                        model.layers[s]->parameters(), fsdp_sharding(*unit)});
      }
      PipelineExecutor exec(plan, mesh.comm("pp"), mine, mse, {{rows / dp, kDim}});
      const auto lx = dp_rows(xs, d, dp), ly = dp_rows(ys, d, dp);
      exec.step(lx, ly);
      if (mesh.coord("pp") != 0) return;
      INFO("defer " << defer << ", rank " << world.rank() << ": " << log.dump());
      long last_wgrad0 = -1;
      for (int k = 0;; ++k) {
        const long at = log.find("wgrad 0", k);
        if (at < 0) break;
        last_wgrad0 = at;
      }
      const long reduce2 = log.find("RS stage2 root");
      CHECK(last_wgrad0 >= 0);
      CHECK(reduce2 >= 0);
      CHECK(reduce2 < last_wgrad0);
      CHECK(log.find("RS stage0 root") > last_wgrad0);  // stage 0's own, after its last backward
      // Whether stage 0 computed a weight gradient while stage 2's reduce-scatter was in flight.
      const long done2 = log.find("RS_done stage2 root");
      REQUIRE(done2 > reduce2);
      bool overlapped = false;
      for (int k = 0;; ++k) {
        const long at = log.find("wgrad 0", k);
        if (at < 0) break;
        overlapped |= at > reduce2 && at < done2;
      }
      CHECK(overlapped == defer);
    });
  }
}

// PyTorch 2.15's register_custom_function: a function in place of the executor's own for an
// action type. One wraps every forward (it sees each, in the plan's order, and the results stay the
// reference's through run_default); one replaces BACKWARD_WEIGHT by nothing (the weights then get no
// gradient: the executor's own W did not run); sends cannot be replaced.
TEST_CASE("custom functions wrap or replace an action type; messages cannot be replaced") {
  const ScheduleSpec spec{2, 2, 4};
  const auto plan = make_plan(*make_schedule("ZBVZeroBubble"), spec);
  const auto want = reference_grads(spec.num_stages(), spec.microbatches);
  for (bool skip_w : {false, true})
    test::run_ranks(spec.pp, [&](comm::Comm& comm) {
      Model model(spec.num_stages());
      auto mine = plain_stages(plan, model, comm.rank());
      PipelineExecutor exec(plan, comm, mine, mse, {{kMicro, kDim}});
      std::vector<std::string> seen;
      exec.register_custom_function(ActionType::kForward, [&](ActionContext& ctx) {
        seen.push_back(to_string(ctx.action));
        CHECK(ctx.stage.index == ctx.action.stage);
        ctx.run_default();
      });
      if (skip_w) exec.register_custom_function(ActionType::kBackwardWeight, [](ActionContext&) {});
      CHECK_THROWS_WITH_AS(exec.register_custom_function(ActionType::kSendF, [](ActionContext&) {}),
                           doctest::Contains("SEND_F carries the schedule's messages"),
                           std::invalid_argument);
      const auto b = make_batch(spec.microbatches);
      exec.step(b.x, b.y);
      std::vector<std::string> forwards;
      for (const auto& a : plan.lowered[comm.rank()])
        if (a.type == ActionType::kForward) forwards.push_back(to_string(a));
      CHECK(seen == forwards);
      for (const auto& st : mine) {
        INFO("skip W " << skip_w << ", stage " << st.index);
        const auto& g = model.layers[st.index]->weight.grad();
        if (skip_w)
          CHECK(!g.defined());
        else
          CHECK(rel(g, want[st.index][0]) < 1e-5);
      }
    });
}

TEST_CASE("a custom schedule from a CSV file in tests/ runs end to end and matches") {
  std::ifstream f(FSDPP_TEST_DATA "/custom_1f1b.csv");
  REQUIRE(f);
  TableSchedule table("custom_1f1b", parse_csv(f));
  check_pipelined(make_plan(table, {2, 1, 4}), reference_grads(2, 4), reference_params(2, 4),
                  "custom_1f1b.csv");
}

TEST_CASE(
    "messages between two ranks match by order, as on NCCL: receives out of send order get the wrong data") {
  // The executor sends every message with one tag, so Gloo matches them as NCCL does, and every
  // test above also proves its plan's order. Here the zero-bubble V schedule without the
  // lowering's reordering: rank 1 consumes gradients in another order than rank 0 sends them, and
  // posting receives right before their use hands them the wrong messages.
  const ScheduleSpec spec{2, 2, 4};
  const auto plan = make_plan(*make_schedule("ZBVZeroBubble"), spec);
  Plan unordered = plan;
  unordered.lowered = add_send_recv(plan.compute, plan.owner);
  REQUIRE_THROWS_AS(check_point_to_point_order(unordered.lowered, unordered.owner), ScheduleError);
  const auto want = reference_grads(spec.num_stages(), spec.microbatches);
  std::vector<double> error(2, 0), ordered_error(2, 0);
  for (const Plan* p : std::vector<const Plan*>{&plan, &unordered})
    test::run_ranks(spec.pp, [&](comm::Comm& comm) {
      Model model(spec.num_stages());
      auto mine = plain_stages(*p, model, comm.rank());
      PipelineExecutor exec(*p, comm, mine, mse, {{kMicro, kDim}});
      const auto b = make_batch(spec.microbatches);
      exec.step(b.x, b.y);
      double worst = 0;
      for (const auto& st : mine)
        worst = std::max(worst, rel(model.layers[st.index]->weight.grad(), want[st.index][0]));
      (p == &plan ? ordered_error : error)[comm.rank()] = worst;
    });
  CHECK(std::max(ordered_error[0], ordered_error[1]) < 1e-5);
  CHECK(std::max(error[0], error[1]) > 1e-2);
}

TEST_CASE("an action table PyTorch 2.15 wrote (ZBVZeroBubble, pp 2, 4 microbatches) runs and matches") {
  // tests/pipeline/torch_zbv_pp2_m4.csv is ScheduleZBVZeroBubble's _dump_csv(format="compute_only");
  // pipeline.torch_orders checks that it still is what PyTorch writes.
  auto table = load_table_schedule(FSDPP_TEST_DATA "/torch_zbv_pp2_m4.csv");
  const auto plan = make_plan(*table, {2, 2, 4});
  CHECK(plan.owner == std::vector<int>{0, 1, 1, 0});  // the V layout, read from the table
  check_pipelined(plan, reference_grads(4, 4), reference_params(4, 4), "torch_zbv_pp2_m4.csv");
}

// The budget seen from the wire: every send is slowed by 50 ms, and a decorator of the pipeline
// communicator (and of the edges split from it) counts the sends in flight. Unbudgeted, the same
// schedules put more than 2 in flight at once, so the check can see a budget that is not kept.
TEST_CASE(
    "a send budget, observed on the wire: never more sends in flight than it allows, the same results") {
  for (const auto& [name, v] :
       std::vector<std::pair<std::string, int>>{{"1F1B", 1}, {"Interleaved1F1B", 2}, {"ZBVZeroBubble", 2}})
    for (int budget : {1, 2, 0}) {
      const ScheduleSpec spec{4, v, 8};
      const auto plan = make_plan(*make_schedule(name), spec, {.max_outstanding_sends = budget});
      const auto want = reference_grads(spec.num_stages(), 8);
      std::mutex mu;
      int peak = 0;  // over the ranks
      test::run_ranks(4, [&](comm::Comm& world) {
        auto flights = std::make_shared<test::SlowSendComm::Flights>(std::chrono::milliseconds(50));
        comm::Comm comm(std::make_shared<test::SlowSendComm>(world.impl_ptr(), flights));
        Model model(spec.num_stages());
        auto mine = plain_stages(plan, model, comm.rank());
        {
          PipelineExecutor exec(plan, comm, mine, mse, {{kMicro, kDim}});
          const auto b = make_batch(8);
          exec.step(b.x, b.y);
          INFO(name << " budget " << budget << " rank " << comm.rank());
          CHECK(exec.stats().sends > 0);
          if (budget > 0) CHECK(flights->peak <= budget);
          for (const auto& st : mine)
            CHECK(rel(model.layers[st.index]->weight.grad(), want[st.index][0]) < 1e-5);
        }
        std::lock_guard<std::mutex> lock(mu);
        peak = std::max(peak, flights->peak);
      });
      INFO(name << " budget " << budget);
      if (budget == 0) CHECK(peak > 2);
    }
}

TEST_CASE("5 AdamW steps of 1F1B at pp 4 match unpipelined training; two runs are bitwise equal") {
  const int pp = 4, m = 8;
  const auto plan = make_plan(*make_schedule("1F1B"), {pp, 1, m});
  auto train_pipelined = [&](std::vector<std::vector<at::Tensor>>& params_out) {
    params_out.assign(pp, {});
    std::vector<double> losses(5, 0);
    test::run_ranks(pp, [&](comm::Comm& comm) {
      Model model(pp);
      const int s = comm.rank();
      PipelineExecutor exec(plan, comm,
                            {{s, [&model, s](const at::Tensor& x) { return model.stage(s, x); },
                              model.layers[s]->parameters()}},
                            mse, {{kMicro, kDim}});
      torch::optim::AdamW opt(model.layers[s]->parameters(), torch::optim::AdamWOptions(1e-2));
      const auto b = make_batch(m);
      for (int step = 0; step < 5; ++step) {
        opt.zero_grad();
        const double loss = exec.step(b.x, b.y);
        opt.step();
        if (s == pp - 1) losses[step] = loss;
      }
      for (auto& p : model.layers[s]->parameters()) params_out[s].push_back(p.detach().clone());
    });
    return losses;
  };
  std::vector<std::vector<at::Tensor>> p1, p2;
  const auto l1 = train_pipelined(p1);
  const auto l2 = train_pipelined(p2);

  Model ref(pp);
  torch::optim::AdamW opt(
      [&] {
        std::vector<at::Tensor> all;
        for (auto& l : ref.layers)
          for (auto& p : l->parameters()) all.push_back(p);
        return all;
      }(),
      torch::optim::AdamWOptions(1e-2));
  const auto b = make_batch(m);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto h = at::cat(b.x);
    for (int s = 0; s < pp; ++s) h = ref.stage(s, h);
    auto loss = at::mse_loss(h, at::cat(b.y));
    loss.backward();
    opt.step();
    CHECK(std::abs(l1[step] - loss.item<double>()) <= 1e-5 * loss.item<double>());
  }
  for (int s = 0; s < pp; ++s)
    for (size_t i = 0; i < p1[s].size(); ++i) {
      CHECK(rel(p1[s][i], ref.layers[s]->parameters()[i]) < 1e-5);
      CHECK(at::equal(p1[s][i], p2[s][i]));  // deterministic
    }
  CHECK(l1 == l2);
}

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
          auto* unit = units.back().ptr().get();
          const bool last = s == stages - 1;
          mine.push_back({s,
                          [unit, last](const at::Tensor& x) {
                            auto y = unit->forward(x);
                            return last ? y : at::tanh(y);
                          },
                          model.layers[s]->parameters(), fsdp_sharding(*unit)});
          for (auto& p : unit->sharded_parameters()) sharded.push_back(p);
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
