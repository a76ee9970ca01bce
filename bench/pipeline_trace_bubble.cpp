// A pipeline's bubble with real compute, measured from a training run's trace, beside the
// simulator's prediction for the same plan with the costs the trace measured.
//   fsdpp_pipeline_trace_bubble TRACE.json SCHEDULE PP STAGES_PER_RANK MICROBATCHES
// The trace comes from `fsdpp run ... --trace`: each "pipeline step" span on a rank's compute track
// holds that rank's stage computations (0F3, 1B2, ...). Measured bubble of a rank = 1 - (time in
// stage computations) / (pipeline step time). The simulator gets, for each (stage, F/B/I/W), the
// median duration measured, and no communication cost: the difference between the two is what
// sends, receives, waits and the framework add.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/simulator.hpp"

using namespace fsdpp::pipeline;
using nlohmann::json;

namespace {

// A stage computation's span name (0F3, 1B2, 1I0, 0W5), or nothing.
std::optional<Action> computation(const std::string& name) {
  try {
    const auto a = parse_action(name);
    using T = ActionType;
    if (a.type == T::kForward || a.type == T::kBackward || a.type == T::kBackwardInput ||
        a.type == T::kBackwardWeight)
      return a;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: fsdpp_pipeline_trace_bubble TRACE.json SCHEDULE PP STAGES_PER_RANK MICROBATCHES\n";
    return 2;
  }
  try {
    const ScheduleSpec spec{
        .pp = std::stoi(argv[3]), .stages_per_rank = std::stoi(argv[4]), .microbatches = std::stoi(argv[5])};
    const auto plan = make_plan(*make_schedule(argv[2]), spec, {.fsdp_stages = true});
    std::ifstream in(argv[1]);
    if (!in) throw std::runtime_error(fmt::format("cannot read {}", argv[1]));
    const auto trace = json::parse(in);

    struct Span {
      double begin, end;
      std::string name;
    };
    std::map<int, std::vector<Span>> steps, computes;  // by rank
    for (const auto& e : trace.at("traceEvents")) {
      if (e.value("ph", "") != "X" || e.value("cat", "") != "compute") continue;
      const double ts = e.at("ts"), dur = e.at("dur");
      const std::string name = e.at("name");
      const int rank = e.at("pid");
      if (name == "pipeline step")
        steps[rank].push_back({ts, ts + dur, name});
      else if (computation(name))
        computes[rank].push_back({ts, ts + dur, name});
    }
    if (steps.size() != static_cast<size_t>(spec.pp))
      throw std::runtime_error(
          fmt::format("{}: pipeline steps traced on {} ranks, expected {}", argv[1], steps.size(), spec.pp));

    Costs costs;
    std::map<std::pair<int, ActionType>, std::vector<double>> durations;
    std::vector<double> measured_bubble(spec.pp), step_ms(spec.pp);
    for (auto& [rank, spans] : steps) {
      std::vector<double> bubbles, lengths;
      for (const auto& st : spans) {
        double busy = 0;
        for (const auto& c : computes[rank])
          if (c.begin >= st.begin && c.end <= st.end) {
            busy += c.end - c.begin;
            const auto a = *computation(c.name);
            durations[{a.stage, a.type}].push_back(c.end - c.begin);
          }
        bubbles.push_back(1 - busy / (st.end - st.begin));
        lengths.push_back((st.end - st.begin) / 1e3);
      }
      measured_bubble[rank] = median(bubbles);
      step_ms[rank] = median(lengths);
    }
    for (const auto& [key, v] : durations) costs.per_stage[key] = median(v) / 1e3;  // ms
    const auto sim = simulate(plan.lowered, plan.owner, costs, plan.max_outstanding_sends);
    std::cout << fmt::format("# {} pp={} stages/rank={} microbatches={}: {} traced steps\n", argv[2], spec.pp,
                             spec.stages_per_rank, spec.microbatches, steps.begin()->second.size());
    std::cout << "measured costs (ms, median):";
    for (const auto& [key, ms] : costs.per_stage)
      std::cout << fmt::format(" {}{}={:.1f}", key.first, type_token(key.second), ms);
    std::cout << "\n";
    for (int r = 0; r < spec.pp; ++r)
      std::cout << fmt::format(
          "RESULT rank={} measured_bubble={:.3f} simulated_bubble={:.3f} measured_step_ms={:.1f} "
          "simulated_step_ms={:.1f}\n",
          r, measured_bubble[r], sim.bubble[r], step_ms[r], sim.makespan);
    double mean_measured = 0;
    for (double b : measured_bubble) mean_measured += b / spec.pp;
    std::cout << fmt::format("RESULT mean measured_bubble={:.3f} simulated_bubble={:.3f}\n", mean_measured,
                             sim.mean_bubble());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fsdpp_pipeline_trace_bubble: " << e.what() << "\n";
    return 1;
  }
}
