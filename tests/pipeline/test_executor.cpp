// The executor runs every built-in schedule on real stages over Gloo and gives the gradients of
// the unpipelined model.
#include "pipeline/executor_fixture.hpp"

using namespace executor_test;

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
  // Every built-in at budget 1, receives posted late (defer_pp_recv): where no send wait can move
  // earlier to keep the budget (PyTorch 2.15 refuses these), make_plan keeps it at run time and
  // hoists receives; the plain lowering (receives deferred as 2.15 defers them, in peer send order)
  // deadlocks in the simulator; the hoisted plan runs on real ranks and trains like the
  // unpipelined model. Where a wait can move, the plan is the plain one with its waits moved.
  int needed = 0, ran = 0, moved = 0;
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
          auto plain =
              defer_receives(add_send_recv(plan.compute, plan.owner, /*early_receives=*/true), plan.owner);
          order_receives(plain, plan.owner);
          plain = add_send_waits(plain);
          try {
            const auto budgeted = add_send_budget_waits(plain, plan.owner, 1);
            CHECK((budgeted == plan.lowered));
            moved += budgeted != plain;
            continue;
          } catch (const ScheduleError&) {
          }
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
  MESSAGE(needed << " (schedule, pp, v, m) plans needed hoisted receives at budget 1, " << moved
                 << " kept it with moved waits");
  CHECK(needed > 0);
  CHECK(moved > 0);
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
        mine.push_back(sharded_stage(model, s, units.back()));
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
