#pragma once
// Simulator: runs a lowered program (compute, sends, receives) against per-action costs and
// reports each rank's timeline, bubble fraction, and peak live activations and receive buffers.
// Model: a send takes effect when issued and never blocks; a receive waits for its send; a
// compute action needs its input (received, or produced earlier on the same rank). A program in
// which no rank can make progress is a deadlock, reported with every rank's blocking action.

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "pipeline/action.hpp"

namespace fsdpp::pipeline {

struct Costs {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1, comm = 0;
  double of(ActionType t) const {
    switch (t) {
      case ActionType::kForward: return forward;
      case ActionType::kBackward: return backward;
      case ActionType::kBackwardInput: return backward_input;
      case ActionType::kBackwardWeight: return backward_weight;
      default: return 0;
    }
  }
};

struct Span {
  Action action;
  double start, end;
};

struct SimResult {
  double makespan = 0;
  std::vector<std::vector<Span>> spans;  // compute actions per rank
  std::vector<double> busy, bubble;      // bubble = 1 - busy / makespan
  std::vector<int> peak_activations, peak_recv_buffers;
  double mean_bubble() const {
    double s = 0;
    for (double b : bubble) s += b;
    return bubble.empty() ? 0 : s / bubble.size();
  }
};

inline SimResult simulate(const Program& program, const std::vector<int>& owner, const Costs& costs = {}) {
  using T = ActionType;
  const int ranks = static_cast<int>(program.size()), stages = static_cast<int>(owner.size());
  SimResult res;
  res.spans.resize(ranks);
  res.busy.assign(ranks, 0);
  res.peak_activations.assign(ranks, 0);
  res.peak_recv_buffers.assign(ranks, 0);
  std::vector<size_t> next(ranks, 0);
  std::vector<double> clock(ranks, 0);
  std::vector<int> live_act(ranks, 0), live_buf(ranks, 0);
  std::map<std::tuple<int, int, int>, double> sent;        // (stage, type, mb) -> time
  std::vector<std::set<std::tuple<int, int, int>>> have(ranks);  // received or produced inputs
  std::vector<std::set<std::tuple<int, int, int>>> consumed(ranks);  // receive buffers used up
  auto key = [](int s, T t, int mb) { return std::make_tuple(s, static_cast<int>(t), mb); };

  // Why a rank's next action cannot run, or "" when it can.
  auto blocked = [&](int r, const Action& a) -> std::string {
    switch (a.type) {
      case T::kRecvF:
        return sent.count(key(a.stage - 1, T::kSendF, a.microbatch)) ? ""
               : "waits for " + std::to_string(a.stage - 1) + "SEND_F" + std::to_string(a.microbatch);
      case T::kRecvB:
        return sent.count(key(a.stage + 1, T::kSendB, a.microbatch)) ? ""
               : "waits for " + std::to_string(a.stage + 1) + "SEND_B" + std::to_string(a.microbatch);
      case T::kForward:
        if (a.stage == 0 || have[r].count(key(a.stage, T::kRecvF, a.microbatch)) ||
            have[r].count(key(a.stage - 1, T::kForward, a.microbatch)))
          return "";
        return "has no input (no " + std::to_string(a.stage) + "RECV_F" + std::to_string(a.microbatch) + " before it)";
      case T::kBackward:
      case T::kBackwardInput:
        if (!have[r].count(key(a.stage, T::kForward, a.microbatch)))
          return "runs before its forward";
        if (a.stage == stages - 1 || have[r].count(key(a.stage, T::kRecvB, a.microbatch)) ||
            have[r].count(key(a.stage + 1, T::kBackward, a.microbatch)) ||
            have[r].count(key(a.stage + 1, T::kBackwardInput, a.microbatch)))
          return "";
        return "has no output gradient (no " + std::to_string(a.stage) + "RECV_B" + std::to_string(a.microbatch) + " before it)";
      case T::kBackwardWeight:
        return have[r].count(key(a.stage, T::kBackwardInput, a.microbatch)) ? "" : "runs before its I";
      case T::kSendF:
        return have[r].count(key(a.stage, T::kForward, a.microbatch)) ? "" : "sends before its forward";
      case T::kSendB:
        return have[r].count(key(a.stage, T::kBackward, a.microbatch)) ||
                       have[r].count(key(a.stage, T::kBackwardInput, a.microbatch))
                   ? ""
                   : "sends before its backward";
      default:
        return "";
    }
  };

  for (;;) {
    bool progress = false, finished = true;
    for (int r = 0; r < ranks; ++r) {
      while (next[r] < program[r].size()) {
        const Action& a = program[r][next[r]];
        const std::string why = blocked(r, a);
        if (!why.empty()) {
          // Missing inputs that no send can ever provide are errors in the program itself.
          if (a.type != T::kRecvF && a.type != T::kRecvB)
            throw ScheduleError("rank " + std::to_string(r) + ": " + to_string(a) + " " + why);
          break;
        }
        progress = true;
        double& t = clock[r];
        if (a.type == T::kRecvF || a.type == T::kRecvB) {
          const auto s = sent.at(key(a.type == T::kRecvF ? a.stage - 1 : a.stage + 1,
                                     a.type == T::kRecvF ? T::kSendF : T::kSendB, a.microbatch));
          t = std::max(t, s + costs.comm);
          have[r].insert(key(a.stage, a.type, a.microbatch));
          res.peak_recv_buffers[r] = std::max(res.peak_recv_buffers[r], ++live_buf[r]);
        } else if (a.type == T::kSendF || a.type == T::kSendB) {
          sent[key(a.stage, a.type, a.microbatch)] = t;
        } else if (is_compute(a.type)) {
          const double d = costs.of(a.type);
          res.spans[r].push_back({a, t, t + d});
          t += d;
          res.busy[r] += d;
          have[r].insert(key(a.stage, a.type, a.microbatch));
          // A received input is consumed by the compute that needed it.
          const auto recv = a.type == T::kForward ? T::kRecvF : T::kRecvB;
          if (a.type != T::kBackwardWeight && have[r].count(key(a.stage, recv, a.microbatch)) &&
              consumed[r].insert(key(a.stage, recv, a.microbatch)).second)
            --live_buf[r];
          // Activations live from F until the last backward that needs them (B, or W after I).
          if (a.type == T::kForward) res.peak_activations[r] = std::max(res.peak_activations[r], ++live_act[r]);
          if (a.type == T::kBackward || a.type == T::kBackwardWeight) --live_act[r];
        }
        ++next[r];
      }
      if (next[r] < program[r].size()) finished = false;
    }
    if (finished) break;
    if (!progress) {
      std::string stuck;
      for (int r = 0; r < ranks; ++r)
        if (next[r] < program[r].size())
          stuck += (stuck.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " at " +
                   to_string(program[r][next[r]]) + " " + blocked(r, program[r][next[r]]);
      throw ScheduleError("the schedule deadlocks: " + stuck);
    }
  }
  res.makespan = *std::max_element(clock.begin(), clock.end());
  for (int r = 0; r < ranks; ++r)
    res.bubble.push_back(res.makespan > 0 ? 1 - res.busy[r] / res.makespan : 0);
  return res;
}

}  // namespace fsdpp::pipeline
