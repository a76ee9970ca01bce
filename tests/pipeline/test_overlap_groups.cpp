// OVERLAP_F_B groups as the executor runs them, observed with slowed computations.
#include "pipeline/executor_fixture.hpp"

using namespace executor_test;

namespace {

// The stages of `model` on `rank`, each forward and backward slowed by sleeps (so that timings
// stand out on any machine): forward_ms[s] before stage s's forward, backward_ms[s] in its backward.
std::vector<PipelineStage> slow_stages(const Plan& plan, Model& model, int rank, std::vector<int> forward_ms,
                                       std::vector<int> backward_ms) {
  std::vector<PipelineStage> mine;
  for (int s = 0; s < plan.spec.num_stages(); ++s)
    if (plan.owner[size_t(s)] == rank)
      mine.push_back(
          {s,
           [&model, s, f = forward_ms[size_t(s)], b = backward_ms[size_t(s)]](const at::Tensor& x) {
             std::this_thread::sleep_for(std::chrono::milliseconds(f));
             auto y = model.stage(s, x);
             y.register_hook([b](const at::Tensor& g) {
               std::this_thread::sleep_for(std::chrono::milliseconds(b));
               return g;
             });
             return y;
           },
           model.layers[size_t(s)]->parameters()});
  return mine;
}

using Clock = std::chrono::system_clock;
using Spans = std::map<std::string, std::pair<Clock::time_point, Clock::time_point>>;  // "1F3" -> begin, end

int64_t micros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

// Runs one step of `plan` on `stages(model, rank)`: each computation's span, each send's issue time
// by its label ("pp 0SEND_F2"), and the gradients checked against the unpipelined model's.
template <typename MakeStages>
std::pair<Spans, std::map<std::string, int64_t>> timed_step(const Plan& plan, MakeStages stages) {
  const auto want = reference_grads(plan.spec.num_stages(), plan.spec.microbatches);
  std::mutex mu;
  Spans spans;
  std::map<std::string, int64_t> issued_us;
  test::run_ranks(plan.spec.pp, [&](comm::Comm& comm) {
    Model model(plan.spec.num_stages());
    auto mine = stages(model, comm.rank());
    ExecutorOptions options{.activation_shape = {kMicro, kDim}};
    options.on_compute = [&](const Action& a, Clock::time_point begin, Clock::time_point end) {
      std::lock_guard<std::mutex> lock(mu);
      spans[to_string(a)] = {begin, end};
    };
    PipelineExecutor exec(plan, comm, mine, mse, options);
    const auto b = make_batch(plan.spec.microbatches);
    exec.step(b.x, b.y);
    for (const auto& st : mine) CHECK(rel(model.layers[st.index]->weight.grad(), want[st.index][0]) < 1e-5);
    comm.barrier().wait();
    if (comm.rank() == 0)  // every rank's communicators live in this process
      for (const auto& rec : nlohmann::json::parse(comm::flight_records_json()))
        for (const auto& e : rec["entries"])
          if (e["op"] == "send") issued_us[e["label"]] = e["issued_us"];
    comm.barrier().wait();
  });
  return {spans, issued_us};
}

}  // namespace

// DualPipeV's OVERLAP_F_B groups: a group's first computation's send goes out as soon as it is
// computed, in flight while the other computes (2.15's runtime issues both sends after both; run
// that way, no send of a group is issued before its other computation ends). Forwards take 30 ms
// and backwards 60 ms.
TEST_CASE("OVERLAP_F_B: a group's first send is in flight while its other computation runs") {
  const auto plan = make_plan(*make_schedule("DualPipeV"), {2, 2, 5});
  const auto [spans, issued_us] = timed_step(plan, [&](Model& model, int rank) {
    return slow_stages(plan, model, rank, {30, 30, 30, 30}, {60, 60, 60, 60});
  });
  int groups = 0, first_sends = 0, sent_early = 0;
  for (int r = 0; r < plan.spec.pp; ++r) {
    const auto& l = plan.lowered[size_t(r)];
    for (size_t i = 0; i < l.size(); ++i) {
      if (group_end(l, i) != i + 2) continue;
      ++groups;
      const auto& first = spans.at(to_string(l[i]));
      const auto& second = spans.at(to_string(l[i + 1]));
      CAPTURE(to_string(l[i]));
      if (first.first > second.first || !matching_recv(l[i + 2]) || l[i + 2].stage != l[i].stage) continue;
      ++first_sends;  // it ran first, and its send is the first to follow the group
      if (issued_us.at("pp " + to_string(l[i + 2])) <= micros(second.first)) ++sent_early;
    }
  }
  CHECK(groups >= 4);
  CHECK(first_sends >= 2);
  CHECK(sent_early == first_sends);
}

// A group computes first whichever computation has its input: rank 0's (3F1;0B0) finds 0B0's input
// gradient here and 3F1's input still being computed on rank 1 (stage 2's forward takes 150 ms), so
// 0B0 runs while it arrives. Run in the table's order, 3F1 would wait for its input and 0B0 after it.
TEST_CASE("OVERLAP_F_B: a group runs first the computation whose input is here") {
  std::istringstream csv(
      "0F0,3F0,3B0,0F1,(3F1;0B0)OVERLAP_F_B,3B1,0B1\n"
      "1F0,2F0,2B0,1B0,1F1,2F1,2B1,1B1\n");
  const TableSchedule table("t", parse_csv(csv));
  const auto plan = make_plan(table, {2, 2, 2});
  const auto [spans, issued_us] = timed_step(plan, [&](Model& model, int rank) {
    return slow_stages(plan, model, rank, {60, 0, 150, 0}, {0, 0, 0, 0});
  });
  const int64_t input_sent = issued_us.at("pp 2SEND_F1");  // 3F1's input leaves rank 1
  CHECK(micros(spans.at("0B0").second) < input_sent);
  CHECK(spans.at("0B0").second <= spans.at("3F1").first);
}

// A custom function for OVERLAP_F_B (2.15's register_custom_function(OVERLAP_F_B, ...)) takes each
// group whole: here it runs the group's computations in reverse, or the executor's way, and the
// gradients are the unpipelined model's either way. One that leaves a computation unrun, or runs
// one that is not its group's, is named (on one rank, DualPipeV at pp 1, where no peer waits).
TEST_CASE("a custom function for OVERLAP_F_B takes each group whole") {
  for (const std::string how : {"reverse", "default", "skip", "stranger"}) {
    const int pp = how == "reverse" || how == "default" ? 2 : 1;
    const auto plan = make_plan(*make_schedule("DualPipeV"), {pp, 2, 2 * pp + 1});
    const auto want = reference_grads(plan.spec.num_stages(), plan.spec.microbatches);
    test::run_ranks(pp, [&](comm::Comm& comm) {
      Model model(plan.spec.num_stages());
      auto mine = plain_stages(plan, model, comm.rank());
      PipelineExecutor exec(plan, comm, mine, mse, {{kMicro, kDim}});
      std::vector<std::string> seen;
      exec.register_custom_function(ActionType::kOverlapFB, [&](ActionContext& ctx) {
        seen.push_back(cells(ctx.group).front());
        CHECK(ctx.action == ctx.group.front());
        if (how == "default") return ctx.run_default();
        if (how == "stranger") return ctx.run({ctx.action.stage, ActionType::kForward, 99});
        for (auto it = ctx.group.rbegin(); it != ctx.group.rend() - (how == "skip"); ++it) ctx.run(*it);
      });
      const auto b = make_batch(plan.spec.microbatches);
      INFO(how << " rank " << comm.rank());
      if (pp == 1) {
        CHECK_THROWS_WITH_AS(
            exec.step(b.x, b.y),
            doctest::Contains(how == "skip" ? "returned without running" : "F99, which is not"),
            ScheduleError);
        return;
      }
      exec.step(b.x, b.y);
      std::vector<std::string> groups;
      for (const auto& cell : cells(plan.lowered[comm.rank()]))
        if (cell.front() == '(') groups.push_back(cell);
      CHECK(seen == groups);
      CHECK(!groups.empty());
      for (const auto& st : mine) CHECK(rel(model.layers[st.index]->weight.grad(), want[st.index][0]) < 1e-5);
    });
  }
}
