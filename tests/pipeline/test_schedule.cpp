// Schedules as data: text form, built-ins, lowering, validation and simulation.
#include <doctest/doctest.h>

#include <set>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/table.hpp"
#include "pipeline/schedule_test_util.hpp"

using namespace fsdpp::pipeline;

using namespace schedule_test;

TEST_CASE("actions print and parse losslessly, in PyTorch's notation") {
  for (const std::string s : {"0F1", "2I1", "0W3", "0B3", "1UNSHARD", "3RESHARD", "2SEND_B2", "1RECV_F1",
                              "0REDUCE_GRAD", "12SEND_F345", "7RECV_B0"})
    CHECK(to_string(parse_action(s)) == s);
  CHECK(error_of([] { parse_action("F1"); }).find("must start with a stage number") != std::string::npos);
  CHECK(error_of([] { parse_action("0X1"); }).find("unknown type 'X'") != std::string::npos);
  CHECK(error_of([] { parse_action("0F"); }).find("a microbatch number must follow F") != std::string::npos);
  CHECK(error_of([] { parse_action("1UNSHARD2"); }).find("UNSHARD takes no microbatch") != std::string::npos);
  // CSV errors carry the line and column of the bad cell.
  const auto msg = error_of([] { from_csv("0F0,0B0\n1F0, 1Q0\n"); });
  CHECK(msg.find("line 2, column 6: '1Q0'") != std::string::npos);
}

TEST_CASE("WAIT_REDUCE_GRAD: placed as PyTorch 2.15 places it, and a table that misplaces it is refused") {
  const auto parse = [](std::vector<std::string> texts) {
    std::vector<Action> rank;
    for (const auto& t : texts) rank.push_back(parse_action(t));
    return Program{rank};
  };
  // Two stages on one rank, 1 microbatch: right after each reduction, or before the next one.
  const auto compute = parse({"0F0", "1F0", "1B0", "0B0"});
  CHECK(add_reduce_grad(compute, 1, false) == parse({"0F0", "1F0", "1B0", "1REDUCE_GRAD", "1WAIT_REDUCE_GRAD",
                                                     "0B0", "0REDUCE_GRAD", "0WAIT_REDUCE_GRAD"}));
  CHECK(add_reduce_grad(compute, 1, true) ==
        parse({"0F0", "1F0", "1B0", "1REDUCE_GRAD", "0B0", "1WAIT_REDUCE_GRAD", "0REDUCE_GRAD",
               "0WAIT_REDUCE_GRAD"}));
  for (bool defer : {false, true}) CHECK_NOTHROW(validate_reduce_waits(add_reduce_grad(compute, 1, defer)));
  CHECK_THROWS_WITH_AS(validate_reduce_waits(parse({"0B0", "0REDUCE_GRAD"})),
                       doctest::Contains("0REDUCE_GRAD is never waited"), ScheduleError);
  CHECK_THROWS_WITH_AS(validate_reduce_waits(parse({"1REDUCE_GRAD", "0REDUCE_GRAD", "1WAIT_REDUCE_GRAD"})),
                       doctest::Contains("stage 1's REDUCE_GRAD is still pending"), ScheduleError);
  CHECK_THROWS_WITH_AS(validate_reduce_waits(parse({"0WAIT_REDUCE_GRAD"})),
                       doctest::Contains("waits for a REDUCE_GRAD that is not pending"), ScheduleError);
}

TEST_CASE(
    "WAIT_SEND_F / WAIT_SEND_B: placed as PyTorch 2.15 places them, and a table that misplaces one is "
    "refused") {
  // 1F1B, pp 2, 2 microbatches (receives deferred): a forward output's send is waited after the local backward of that
  // microbatch; input gradients' sends at the end, in the order sent.
  const auto plan = make_plan(*make_schedule("1F1B"), {2, 1, 2}, {.defer_pp_recv = true});
  CHECK(joined(plan.lowered[0]) ==
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0WAIT_SEND_F0 0RECV_B1 0B1 0WAIT_SEND_F1");
  CHECK(joined(plan.lowered[1]) ==
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1WAIT_SEND_B0 1WAIT_SEND_B1");
  // A lowered table without waits gets them; one with waits keeps them, and each send needs one.
  const auto table = [](const std::string& csv) {
    std::istringstream in(csv);
    Positions where;
    auto program = parse_csv(in, &where);
    return make_plan(TableSchedule("t", std::move(program), std::move(where)), {2, 1, 1});
  };
  CHECK(joined(table("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n").lowered[1]) ==
        "1RECV_F0 1F0 1B0 1SEND_B0 1WAIT_SEND_B0");
  CHECK(joined(table("0F0,0SEND_F0,0RECV_B0,0WAIT_SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,1WAIT_SEND_B0\n")
                   .lowered[0]) == "0F0 0SEND_F0 0RECV_B0 0WAIT_SEND_F0 0B0");
  CHECK(error_of([&] {
          table("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,1WAIT_SEND_B0\n");
        }).find("0SEND_F0 is never waited (add 0WAIT_SEND_F0 after it)") != std::string::npos);
  CHECK(
      error_of([&] {
        table("0F0,0WAIT_SEND_F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,1WAIT_SEND_B0\n");
      }).find("line 1, column 5: 0WAIT_SEND_F0 waits for 0SEND_F0, which this rank has not sent before it") !=
      std::string::npos);
}

TEST_CASE("JSON action tables, with errors naming the JSON path") {
  std::istringstream ok(R"({"ranks": [["0F0", null, "0B0"], ["1F0", "1B0"]]})");
  const auto p = parse_json_table(ok);
  CHECK(joined(p[0]) == "0F0 0B0");
  CHECK(joined(p[1]) == "1F0 1B0");
  std::istringstream bad(R"({"ranks": [["0F0"], ["1F0", "1Z0"]]})");
  CHECK(error_of([&] { parse_json_table(bad); }).find("/ranks/1/1: '1Z0' is not an action") !=
        std::string::npos);
  std::istringstream broken("{\"ranks\": [");
  CHECK(error_of([&] { parse_json_table(broken); }).find("not valid JSON") != std::string::npos);
  const auto path = std::string(FSDPP_TEST_DATA) + "/custom_1f1b.csv";
  CHECK(load_table(path) == load_table(path));  // CSV by extension
  CHECK(error_of([] {
          load_table("/nonexistent/x.json");
        }).find("schedule table /nonexistent/x.json is missing") != std::string::npos);
}

TEST_CASE("CSV round trip, with empty cells as idle slots") {
  const auto p = from_csv("0F0,,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n");
  CHECK(joined(p[0]) == "0F0 0F1 0B0 0B1");
  std::ostringstream out;
  write_csv(out, p);
  CHECK(from_csv(out.str()) == p);
}

TEST_CASE("built-in orders follow their published rules") {
  // Rules as documented for PyTorch's schedules (shared/reference/pipeline-schedules.md, section 2).
  auto order = [](const std::string& name, ScheduleSpec s, int rank) {
    return joined(make_schedule(name)->compute_actions(s)[rank]);
  };
  CHECK(order("1F1B", {4, 1, 8}, 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7");
  CHECK(order("Interleaved1F1B", {4, 2, 8}, 0) ==
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
        "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7");
  CHECK(order("InterleavedZeroBubble", {4, 1, 8}, 1) ==
        "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7");
  CHECK(order("ZBVZeroBubble", {2, 2, 4}, 1) ==
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3");
}

TEST_CASE("every built-in is valid, lowers and runs for pp 2 and 4 and several microbatch counts") {
  struct Case {
    std::string name;
    int v;
  };
  for (const auto& c : std::vector<Case>{{"GPipe", 1},
                                         {"1F1B", 1},
                                         {"LoopedBFS", 2},
                                         {"Interleaved1F1B", 2},
                                         {"InterleavedZeroBubble", 1},
                                         {"InterleavedZeroBubble", 2},
                                         {"ZBVZeroBubble", 2},
                                         {"DualPipeV", 2}})
    for (int pp : {2, 4})
      for (int m : {pp, 2 * pp, 2 * pp + 1}) {
        const ScheduleSpec spec{pp, c.v, m};
        auto s = make_schedule(c.name);
        std::string why;
        try {
          s->check(spec);
        } catch (const ScheduleError& e) {
          why = e.what();
        }
        INFO(c.name << " pp=" << pp << " v=" << c.v << " m=" << m << " " << why);
        if (!why.empty()) {  // interleaved schedules refuse some odd counts, DualPipeV m < 2pp
          CHECK((why.find("must be a multiple") != std::string::npos ||
                 (c.name == "DualPipeV" && m < 2 * pp &&
                  why.find("at least as many microbatches as stages (") != std::string::npos)));
          continue;
        }
        const auto plan = make_plan(*s, spec, {.fsdp_stages = true});
        int sends = 0, recvs = 0, reduces = 0, unshards = 0, reshards = 0;
        for (const auto& rank : plan.lowered)
          for (const auto& a : rank) {
            sends += a.type == ActionType::kSendF || a.type == ActionType::kSendB;
            recvs += a.type == ActionType::kRecvF || a.type == ActionType::kRecvB;
            reduces += a.type == ActionType::kReduceGrad;
            unshards += a.type == ActionType::kUnshard;
            reshards += a.type == ActionType::kReshard;
          }
        CHECK(sends == recvs);
        CHECK(reduces == spec.num_stages());
        CHECK(unshards == reshards);
        CHECK(unshards >= spec.num_stages());
      }
}

TEST_CASE("UNSHARD/RESHARD keep a window of stages gathered, as PyTorch's lowering does") {
  Program compute = {{parse_action("0F0"), parse_action("0F1"), parse_action("1F0"), parse_action("1F1"),
                      parse_action("1B0"), parse_action("1B1"), parse_action("0B0"), parse_action("0B1")}};
  CHECK(joined(add_unshard_reshard(compute, 3)[0]) ==
        "0UNSHARD 1UNSHARD 0F0 0F1 1F0 1F1 1B0 1B1 1RESHARD 0B0 0B1 0RESHARD");
  CHECK(joined(add_unshard_reshard(compute, 1)[0]) ==
        "0UNSHARD 0F0 0F1 0RESHARD 1UNSHARD 1F0 1F1 1B0 1B1 1RESHARD 0UNSHARD 0B0 0B1 0RESHARD");
  // A lookahead of 1 within 2 active stages: stage 1 is gathered only when it is next, and stage 0
  // stays gathered through stage 1's work because it is among the next 2 stages.
  CHECK(joined(add_unshard_reshard(compute, 2, {1})[0]) ==
        "0UNSHARD 0F0 0F1 1UNSHARD 1F0 1F1 1B0 1B1 1RESHARD 0B0 0B1 0RESHARD");
}

TEST_CASE("max_active_stages is a plan option: at most that many stages of a rank are gathered at once") {
  // Interleaved1F1B with 4 stages per rank: w active stages keep min(w, 4) stages gathered at the
  // peak, and fewer gather again more often. The plan checks the option.
  const ScheduleSpec spec{2, 4, 8};
  const auto schedule = make_schedule("Interleaved1F1B");
  int previous_unshards = 0;
  for (int w : {4, 3, 2, 1}) {
    CAPTURE(w);
    const auto plan = make_plan(*schedule, spec, {.fsdp_stages = true, .max_active_stages = w});
    int unshards = 0;
    for (const auto& rank : plan.lowered) {
      std::set<int> gathered;
      size_t peak = 0;
      for (const auto& a : rank) {
        if (a.type == ActionType::kUnshard) gathered.insert(a.stage), ++unshards;
        if (a.type == ActionType::kReshard) gathered.erase(a.stage);
        if (a.type == ActionType::kForward || a.type == ActionType::kBackward)
          CHECK(gathered.count(a.stage) == 1);
        peak = std::max(peak, gathered.size());
      }
      CHECK(peak == size_t(std::min(w, spec.stages_per_rank)));
    }
    CHECK(unshards >= previous_unshards);
    if (w < 4) CHECK(unshards > spec.num_stages());  // some stage is gathered more than once
    previous_unshards = unshards;
  }
  CHECK(make_plan(*schedule, spec, {.fsdp_stages = true, .max_active_stages = 4}).lowered !=
        make_plan(*schedule, spec, {.fsdp_stages = true, .max_active_stages = 1}).lowered);
  const auto why = [&](const PlanOptions& o) {
    try {
      make_plan(*schedule, spec, o);
    } catch (const ScheduleError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(why({.fsdp_stages = true, .max_active_stages = 0}) ==
        "max_active_stages must be at least 1 (the stage being computed), got 0");
  CHECK(why({.fsdp_stages = true, .unshard_lookahead = UnshardLookahead::parse("1,2,3")}) ==
        "unshard lookahead needs one value per pipeline rank (2), got 3");
  CHECK(why({.fsdp_stages = true,
             .max_active_stages = 2,
             .unshard_lookahead = UnshardLookahead::parse("1,3")}) ==
        "unshard lookahead of rank 1 must be in [1, max_active_stages=2], got 3");
}

TEST_CASE("unshard lookahead: \"auto\" resolves to min(rank + 2, max_active_stages), and gathers later") {
  CHECK(resolve_unshard_lookahead(UnshardLookahead::parse("auto"), 4, 3) == std::vector<int>{2, 3, 3, 3});
  CHECK(resolve_unshard_lookahead(UnshardLookahead::parse("full"), 2, 3) == std::vector<int>{3, 3});
  CHECK(resolve_unshard_lookahead(UnshardLookahead::parse("2,1"), 2, 3) == std::vector<int>{2, 1});
  for (const char* bad : {"", "fast", "1,,2", "1,x", "-1"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(UnshardLookahead::parse(bad), ScheduleError);
  }
  CHECK(to_string(UnshardLookahead::parse("auto")) == "auto");
  CHECK(to_string(UnshardLookahead::parse("3,1")) == "3,1");
  // With 4 stages per rank and 3 active, a lookahead of 1 gathers each stage just before its first
  // use: at every compute action, no gathered stage is one the rank has not reached yet, except the
  // one computing. "full" gathers ahead.
  const ScheduleSpec spec{2, 4, 8};
  const auto schedule = make_schedule("Interleaved1F1B");
  const auto ahead = [&](const std::string& lookahead) {
    const auto plan = make_plan(
        *schedule, spec, {.fsdp_stages = true, .unshard_lookahead = UnshardLookahead::parse(lookahead)});
    int most = 0;  // the most stages gathered before their first compute, at any point
    for (const auto& rank : plan.lowered) {
      std::set<int> waiting;
      for (const auto& a : rank) {
        if (a.type == ActionType::kUnshard) waiting.insert(a.stage);
        if (a.type == ActionType::kReshard) waiting.erase(a.stage);
        if (a.type == ActionType::kForward || a.type == ActionType::kBackward) waiting.erase(a.stage);
        most = std::max(most, static_cast<int>(waiting.size()));
      }
    }
    return most;
  };
  CHECK(ahead("1,1") == 1);
  CHECK(ahead("full") == 3);
  CHECK(ahead("auto") == 3);  // rank 1 gathers 3 ahead
}

TEST_CASE("simulated bubbles: (p-1)/(m+p-1) for GPipe and 1F1B, less for zero-bubble schedules") {
  for (int pp : {2, 4})
    for (int m : {pp, 2 * pp, 8}) {
      for (const std::string name : {"GPipe", "1F1B"}) {
        const auto plan = make_plan(*make_schedule(name), {pp, 1, m});
        const auto sim = simulate(plan.lowered, plan.owner, Costs{1, 2, 1, 1, 0});
        const double want = double(pp - 1) / (m + pp - 1);
        for (int r = 0; r < pp; ++r) CHECK(sim.bubble[r] == doctest::Approx(want));
        // GPipe keeps every microbatch's activations; 1F1B at most p - r on rank r.
        for (int r = 0; r < pp; ++r)
          CHECK(sim.peak_activations[r] == (name == "GPipe" ? m : std::min(m, pp - r)));
      }
    }
  const Costs uniform{1, 2, 1, 1, 0};  // B = I + W
  const auto one = make_plan(*make_schedule("1F1B"), {4, 1, 8});
  const auto zb1 = make_plan(*make_schedule("InterleavedZeroBubble"), {4, 1, 8});
  const auto zbv = make_plan(*make_schedule("ZBVZeroBubble"), {4, 2, 8});
  const double b1 = simulate(one.lowered, one.owner, uniform).mean_bubble();
  const double bz = simulate(zb1.lowered, zb1.owner, uniform).mean_bubble();
  // ZB-V halves each stage: per-stage costs are half of a one-stage-per-rank model's.
  const double bv = simulate(zbv.lowered, zbv.owner, Costs{0.5, 1, 0.5, 0.5, 0}).mean_bubble();
  MESSAGE("pp=4 m=8 mean bubble: 1F1B " << b1 << ", ZB-H1 " << bz << ", ZB-V " << bv);
  CHECK(bz < b1 * 0.7);
  CHECK(bv < bz);
}

TEST_CASE("invalid schedules are rejected before any communication, naming the rank and action") {
  auto plan_of = [](const std::string& csv, int m) {
    TableSchedule t("custom", from_csv(csv));
    return make_plan(t, {2, 1, m});
  };
  // Rank 1 wants microbatch 1 first, but rank 0 sends microbatch 0 first and waits for its gradient.
  auto msg = error_of([&] { plan_of("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", 2); });
  CHECK(msg.find("deadlocks") != std::string::npos);
  CHECK(msg.find("rank 1 at 1F1") != std::string::npos);
  msg = error_of([&] { plan_of("0F0,0F1,0B0,0B1\n1F0,1F1,1B0\n", 2); });
  CHECK(msg.find("no backward for microbatch 1 of stage 1 (rank 1)") != std::string::npos);
  msg = error_of([&] { plan_of("0F0,0I0,0W0\n1F0,1W0,1I0\n", 1); });
  CHECK(msg.find("rank 1: 1W0 (W) comes before its input gradient 1I0") != std::string::npos);
  msg = error_of([&] { plan_of("0F0,0B0\n1F0,0B0\n", 1); });
  CHECK(msg.find("which rank 0 also runs") != std::string::npos);
  msg = error_of([&] { plan_of("0F0,0B0,0F0\n1F0,1B0\n", 1); });
  CHECK(msg.find("rank 0: 0F0 appears twice") != std::string::npos);
}

TEST_CASE("a custom schedule from a CSV file and one registered in C++ take the built-ins' path") {
  std::ifstream f(FSDPP_TEST_DATA "/custom_1f1b.csv");
  REQUIRE(f);
  TableSchedule table("custom_1f1b", parse_csv(f));
  const auto plan = make_plan(table, {2, 1, 4});
  const auto sim = simulate(plan.lowered, plan.owner);
  CHECK(sim.peak_activations[0] == 3);  // three warm-up forwards
  CHECK(sim.makespan > 0);

  struct Reversed : Schedule {  // GPipe with backwards in reverse microbatch order
    std::string name() const override { return "Reversed"; }
    Program compute_actions(const ScheduleSpec& s) const override {
      Program p(s.pp);
      for (int r = 0; r < s.pp; ++r) {
        for (int m = 0; m < s.microbatches; ++m) p[r].push_back({r, ActionType::kForward, m});
        for (int m = s.microbatches - 1; m >= 0; --m) p[r].push_back({r, ActionType::kBackward, m});
      }
      return p;
    }
  };
  register_schedule("Reversed", [] { return std::make_unique<Reversed>(); });
  const auto names = schedule_names();
  CHECK(std::find(names.begin(), names.end(), "Reversed") != names.end());
  const auto rp = make_plan(*make_schedule("Reversed"), {3, 1, 5});
  CHECK(rp.lowered.size() == 3);
  CHECK(error_of([] { make_schedule("Nope"); }).find("unknown schedule 'Nope' (known: 1F1B,") !=
        std::string::npos);
}

TEST_CASE("table schedules: stages and microbatches out of range are named with their line and column") {
  const auto dir = std::filesystem::temp_directory_path();
  const auto csv = (dir / "fsdpp-table-range.csv").string();
  std::ofstream(csv) << "0F0,0B0\n1F0, 5F0\n";
  auto msg = error_of([&] { make_plan(*load_table_schedule(csv), {2, 1, 1}); });
  CHECK(msg.find(csv + ": line 2, column 6: '5F0' names stage 5, but there are 2 stages") !=
        std::string::npos);
  std::ofstream(csv) << "0F0,0F3,0B0\n1F0,1B0\n";
  msg = error_of([&] { make_plan(*load_table_schedule(csv), {2, 1, 1}); });
  CHECK(msg.find("line 1, column 5: '0F3' names microbatch 3, but there are 1") != std::string::npos);
  const auto json = (dir / "fsdpp-table-range.json").string();
  std::ofstream(json) << R"({"ranks": [["0F0", "0B0"], ["1F0", null, "9B0"]]})";
  msg = error_of([&] { make_plan(*load_table_schedule(json), {2, 1, 1}); });
  CHECK(msg.find("/ranks/1/2: '9B0' names stage 9") != std::string::npos);
  std::filesystem::remove(csv);
  std::filesystem::remove(json);
}

TEST_CASE("sends and receives between two ranks come in the same order (NCCL matches by order)") {
  // Note [point-to-point order]. Every built-in, with and without FSDP's actions and a send budget:
  // make_plan checks the order itself; checked again here on every pair of ranks.
  int plans = 0;
  for (const auto& name : schedule_names()) {
    if (name == "Reversed") continue;  // registered by another test case
    for (int pp : {2, 4})
      for (int v : {1, 2})
        for (int m : {pp, 2 * pp, 2 * pp + 1}) {
          const auto s = make_schedule(name);
          const ScheduleSpec spec{pp, v, m};
          try {
            s->check(spec);
          } catch (const ScheduleError&) {
            continue;  // a layout this schedule does not take
          }
          for (bool fsdp : {false, true})
            for (int budget : {0, 1, 2}) {
              INFO(name << " pp=" << pp << " v=" << v << " m=" << m << " fsdp=" << fsdp
                        << " budget=" << budget);
              const auto plan = make_plan(*s, spec, {.fsdp_stages = fsdp, .max_outstanding_sends = budget});
              CHECK_NOTHROW(check_point_to_point_order(plan.lowered, plan.owner));
              CHECK_NOTHROW(simulate(plan.lowered, plan.owner, {}, budget));  // every receive before its use
              ++plans;
            }
        }
  }
  CHECK(plans >= 6 * 6);  // each built-in, in at least one layout
  // Two forwards that rank 1 receives in the opposite order to rank 0's sends: named by the pair of
  // ranks, the message and both actions.
  std::string msg = error_of([] {
    check_point_to_point_order(from_csv("0F0,0SEND_F0,0F1,0SEND_F1\n1RECV_F1,1F1,1RECV_F0,1F0\n"), {0, 1});
  });
  CHECK(
      msg.find(
          "rank 0 -> rank 1: message 1 is rank 0: 0SEND_F0 but rank 1: 1RECV_F1 (the message of 0SEND_F1)") !=
      std::string::npos);
}

TEST_CASE(
    "zero-bubble schedules consume out of their peers' send order; the lowering posts those receives "
    "earlier") {
  for (const auto& [name, spec] : {std::pair<std::string, ScheduleSpec>{"ZBVZeroBubble", {2, 2, 4}},
                                   {"InterleavedZeroBubble", {2, 2, 8}}}) {
    INFO(name);
    const auto s = make_schedule(name);
    const auto compute = s->compute_actions(spec);
    const auto owner = infer_stage_ranks(compute, spec.num_stages());
    auto lowered = add_send_recv(compute, owner);  // each receive right before its use
    CHECK(error_of([&] { check_point_to_point_order(lowered, owner); }).find("must come in the same order") !=
          std::string::npos);
    const auto before = simulate(lowered, owner);
    order_receives(lowered, owner);
    CHECK_NOTHROW(check_point_to_point_order(lowered, owner));
    const auto after = simulate(lowered, owner);  // still runs, at the same speed
    CHECK(after.makespan == before.makespan);
    // Nothing but receives moved.
    auto without_recvs = [](Program p) {
      for (auto& rank : p)
        rank.erase(std::remove_if(rank.begin(), rank.end(),
                                  [](const Action& a) {
                                    return a.type == ActionType::kRecvF || a.type == ActionType::kRecvB;
                                  }),
                   rank.end());
      return p;
    };
    CHECK(without_recvs(lowered) == without_recvs(add_send_recv(compute, owner)));
  }
}

TEST_CASE("a lowered table keeps its own sends and receives, which are checked") {
  const auto dir = std::filesystem::temp_directory_path();
  const auto csv = (dir / "fsdpp-lowered.csv").string();
  // A built-in's lowered program, written out and read back as a table: the same plan.
  const auto builtin = make_plan(*make_schedule("Interleaved1F1B"), {2, 2, 4});
  {
    std::ofstream f(csv);
    write_csv(f, builtin.lowered);
  }
  const auto table = make_plan(*load_table_schedule(csv), {2, 2, 4});
  CHECK(table.lowered == builtin.lowered);
  CHECK(table.compute == builtin.compute);
  // Receives posted by hand in the opposite order to the sends: the table's line and column.
  std::ofstream(csv) << "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                        "1RECV_F1,1RECV_F0,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n";
  auto msg = error_of([&] { make_plan(*load_table_schedule(csv), {2, 1, 2}); });
  CHECK(msg.find(csv +
                 ": rank 0 -> rank 1: message 1 is line 1, column 5: 0SEND_F0 but line 2, column 1: 1RECV_F1 "
                 "(the message of 0SEND_F1)") != std::string::npos);
  // A receive that is missing, one that is not needed, one twice.
  std::ofstream(csv) << "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                        "1RECV_F0,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n";
  msg = error_of([&] { make_plan(*load_table_schedule(csv), {2, 1, 2}); });
  CHECK(msg.find(csv + ": rank 1 has no 1RECV_F1: the input of 1F1 comes from rank 0") != std::string::npos);
  std::ofstream(csv) << "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0RECV_B1\n"
                        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";
  msg = error_of([&] { make_plan(*load_table_schedule(csv), {2, 1, 2}); });
  CHECK(msg.find(csv + ": line 1, column 53: 0RECV_B1 appears twice") != std::string::npos);
  std::ofstream(csv) << "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                        "1RECV_F0,1F0,1SEND_F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";
  msg = error_of([&] { make_plan(*load_table_schedule(csv), {2, 1, 2}); });
  CHECK(msg.find(csv + ": line 2, column 14: 1SEND_F0: stage 1 has no next stage to talk to") !=
        std::string::npos);
  // A receive after the computation that needs it: the simulator names the rank and action.
  std::ofstream(csv) << "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                        "1RECV_F0,1F0,1B0,1SEND_B0,1F1,1RECV_F1,1B1,1SEND_B1\n";
  msg = error_of([&] { make_plan(*load_table_schedule(csv), {2, 1, 2}); });
  CHECK(msg.find("rank 1: 1F1 has no input (no 1RECV_F1 before it)") != std::string::npos);
  std::filesystem::remove(csv);
}
