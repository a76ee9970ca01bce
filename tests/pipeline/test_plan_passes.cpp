// The plan's passes over OVERLAP_F_B groups and send waits, against what PyTorch 2.15's lowering
// does (pipeline.torch_orders compares the programs themselves).
#include <doctest/doctest.h>

#include <algorithm>

#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/table.hpp"
#include "pipeline/schedule_test_util.hpp"

using namespace schedule_test;

TEST_CASE("OVERLAP_F_B groups: read and written as PyTorch writes them, kept whole, bad groups named") {
  const auto p = from_csv("0F0,(0F1;3B0)OVERLAP_F_B,3W0\n1F0,( 1F1;2B0 )OVERLAP_F_B\n");
  CHECK(joined(p[0]) == "0F0 0F1 3B0 3W0");
  CHECK(std::vector<bool>{p[0][0].with_previous, p[0][1].with_previous, p[0][2].with_previous,
                          p[0][3].with_previous} == std::vector<bool>{false, false, true, false});
  CHECK(cells(p[0]) == std::vector<std::string>{"0F0", "(0F1;3B0)OVERLAP_F_B", "3W0"});
  std::ostringstream out;
  write_csv(out, p);
  CHECK(out.str() == "0F0,(0F1;3B0)OVERLAP_F_B,3W0\n1F0,(1F1;2B0)OVERLAP_F_B\n");
  CHECK(from_csv(out.str()) == p);
  // Its computations run at once: different stages, none consuming what another produces.
  CHECK(error_of([] {
          validate_groups(from_csv("(0F1;0B0)OVERLAP_F_B\n")[0], 0);
        }).find("rank 0: (0F1;0B0)OVERLAP_F_B: 0F1 and 0B0 are on one stage") != std::string::npos);
  CHECK(error_of([] {
          validate_groups(from_csv("(0F1;1F1)OVERLAP_F_B\n")[0], 0);
        }).find("1F1 needs what 0F1 produces, so they cannot run at once") != std::string::npos);
  CHECK(error_of([] {
          validate_groups(from_csv("(1B2;0B2)OVERLAP_F_B\n")[0], 0);
        }).find("0B2 needs what 1B2 produces") != std::string::npos);
  CHECK(error_of([] { from_csv("(0F1)OVERLAP_F_B\n"); }).find("a group holds at least two actions") !=
        std::string::npos);
  // The lowering keeps a group whole: its FSDP actions, waits and receives around it, never inside,
  // its sends right after it in the order of its computations (as 2.15 lowers it).
  const auto dual = make_schedule("DualPipeV");
  for (const bool defer : {false, true})
    for (const int pp : {2, 4}) {
      const auto plan = make_plan(*dual, {.pp = pp, .stages_per_rank = 2, .microbatches = 2 * pp + 1},
                                  {.fsdp_stages = true, .max_active_stages = 2, .defer_pp_recv = defer});
      int groups = 0;
      for (int r = 0; r < pp; ++r) {
        const auto& l = plan.lowered[r];
        for (size_t i = 0; i < l.size(); ++i) {
          const size_t end = group_end(l, i);
          if (end == i + 1) continue;
          ++groups;
          std::vector<Action> sends;
          for (size_t j = i; j < end; ++j) {
            CHECK(is_compute(l[j].type));
            const auto& a = l[j];
            if (a.type == ActionType::kForward && a.stage + 1 < 2 * pp && plan.owner[a.stage + 1] != r)
              sends.push_back({a.stage, ActionType::kSendF, a.microbatch});
            if (a.type == ActionType::kBackward && a.stage > 0 && plan.owner[a.stage - 1] != r)
              sends.push_back({a.stage, ActionType::kSendB, a.microbatch});
          }
          std::vector<Action> after;
          for (size_t j = end; j < l.size() && after.size() < sends.size(); ++j)
            if (matching_recv(l[j])) after.push_back(l[j]);
          CHECK(joined(after) == joined(sends));
          i = end - 1;
        }
      }
      size_t in_compute = 0;
      for (const auto& rank : plan.compute)
        for (const auto& a : rank) in_compute += a.with_previous;
      CHECK(groups == static_cast<int>(in_compute));
      CHECK(groups > 0);
    }
  CHECK(error_of([&] {
          make_plan(*dual, {.pp = 2, .stages_per_rank = 2, .microbatches = 4},
                    {.fsdp_stages = true, .max_active_stages = 1});
        }).find("computes 2 stages at once, more than max_active_stages (1)") != std::string::npos);
  CHECK(error_of([] { from_csv("0F0,(0F1;0SEND_F0)OVERLAP_F_B\n"); })
            .find("line 1, column 10: '0SEND_F0' in (0F1;0SEND_F0)OVERLAP_F_B: a group holds compute actions "
                  "only") != std::string::npos);
  CHECK(error_of([] {
          from_csv("(0F1;0B0)OVERLAP\n");
        }).find("a group must read (action;action...)OVERLAP_F_B") != std::string::npos);
}

// The send budget in the plan, as 2.15's _add_wait_send_budget places it (pipeline.torch_orders
// compares the programs action for action): counted in the program itself, a rank never has more
// sends issued and not yet waited than the budget, at every built-in and budgets 1 and 2; without
// the moved waits (each where _add_wait_send puts it) the same programs exceed it.
TEST_CASE("a send budget moves send waits earlier, so that the program never has more sends unwaited") {
  auto peak_unwaited = [](const Program& program) {
    int peak = 0;
    for (const auto& rank : program) {
      int unwaited = 0;
      for (const auto& a : rank) {
        if (matching_recv(a)) peak = std::max(peak, ++unwaited);
        if (is_send_wait(a.type)) --unwaited;
      }
    }
    return peak;
  };
  int plans = 0, over_without = 0;
  for (const auto& name : schedule_names()) {
    if (name == "Reversed") continue;  // registered by another test case
    for (int pp : {2, 4})
      for (int v : {1, 2}) {
        const auto s = make_schedule(name);
        const ScheduleSpec spec{pp, v, 2 * pp};
        try {
          s->check(spec);
        } catch (const ScheduleError&) {
          continue;
        }
        const auto free = make_plan(*s, spec, {.fsdp_stages = true});
        for (int budget : {1, 2}) {
          INFO(name << " pp=" << pp << " v=" << v << " budget=" << budget);
          const auto plan = make_plan(*s, spec, {.fsdp_stages = true, .max_outstanding_sends = budget});
          CHECK(peak_unwaited(plan.lowered) <= budget);
          CHECK_NOTHROW(simulate(plan.lowered, plan.owner, {}, budget));
          over_without += peak_unwaited(free.lowered) > budget;
          ++plans;
        }
      }
  }
  CHECK(plans >= 20);
  CHECK(over_without == plans);
  // Where no wait can move, the error names the rank, the send and the sends in flight.
  const std::string msg = error_of([] {
    add_send_budget_waits(from_csv("0F0,0SEND_F0,0F1,0SEND_F1,0WAIT_SEND_F0,0WAIT_SEND_F1\n"
                                   "1RECV_F1,1RECV_F0,1F0,1F1\n"),
                          {0, 1}, 1);
  });
  CHECK(msg.find("max_outstanding_sends=1 cannot be kept on rank 0 before 0SEND_F1: no wait of the sends in "
                 "flight (0SEND_F0)") != std::string::npos);
}

TEST_CASE(
    "a lowered table with FSDP actions, as `schedule show --fsdp --out` writes it, plans back as written") {
  for (const std::string name : {"1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"}) {
    CAPTURE(name);
    const auto schedule = make_schedule(name);
    const ScheduleSpec spec{.pp = 2,
                            .stages_per_rank = schedule->layout() == Layout::kV || name != "1F1B" ? 2 : 1,
                            .microbatches = 4};
    const auto written = make_plan(*schedule, spec, {.fsdp_stages = true, .max_active_stages = 2});
    std::ostringstream csv;
    write_csv(csv, written.lowered);
    std::istringstream in(csv.str());
    Positions where;
    auto program = parse_csv(in, &where);
    const TableSchedule table("table.csv", std::move(program), where);
    // The table's own FSDP actions are kept (with other plan options they would come out otherwise).
    const auto read = make_plan(table, spec, {.fsdp_stages = true, .max_active_stages = 3});
    CHECK(joined(read.lowered[0]) == joined(written.lowered[0]));
    CHECK(joined(read.lowered[1]) == joined(written.lowered[1]));
    CHECK(error_of([&] { make_plan(table, spec); })
              .find("holds UNSHARD, RESHARD and REDUCE_GRAD actions, but its "
                    "stages are not sharded") != std::string::npos);
  }
  // Refused with their place in the file: FSDP actions in a compute table, a computation on a
  // resharded stage, a stage left gathered.
  const auto refusal = [](const std::string& text) {
    std::istringstream in(text);
    Positions where;
    auto program = parse_csv(in, &where);
    const TableSchedule table("t.csv", std::move(program), where);
    return error_of([&] { make_plan(table, {.pp = 2, .microbatches = 1}, {.fsdp_stages = true}); });
  };
  CHECK(refusal("0UNSHARD,0F0,0B0,0RESHARD\n1F0,1B0\n")
            .find("t.csv: line 1, column 1: '0UNSHARD' belongs in a "
                  "lowered table") != std::string::npos);
  const std::string tail = "1RECV_F0,1UNSHARD,1F0,1B0,1SEND_B0,1RESHARD,1REDUCE_GRAD,1WAIT_REDUCE_GRAD\n";
  CHECK(refusal("0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD\n" + tail)
            .find("line 1, column 1: '0F0' computes on a resharded stage") != std::string::npos);
  CHECK(refusal("0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD\n" + tail)
            .find("rank 0: stage 0 is still gathered at the end (add its RESHARD)") != std::string::npos);
}
