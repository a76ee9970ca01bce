#pragma once
// Simulator: runs a lowered program (compute, sends, receives) against per-action costs and
// reports each rank's timeline, bubble fraction, and peak live activations, receive buffers and
// sends in flight. Model, as the executor behaves: posting a receive never blocks and allocates
// its buffer; a computation waits for the data it consumes (received, or produced earlier on the
// same rank); a send is issued at once unless the send budget is full. A program in which no rank
// can make progress is a deadlock, reported with every rank's blocking action.

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "fsdpp/pipeline/action.hpp"

namespace fsdpp::pipeline {

struct Costs {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1, comm = 0;
  // The first stage has no input to differentiate: with this set, its B costs B - I and its I
  // nothing, as in the executor.
  bool first_stage_skips_input_grad = false;
  // Costs by (stage, type), used where present: stages that differ (the last one computes the
  // loss), as measured from a trace.
  std::map<std::pair<int, ActionType>, double> per_stage;
  double of(ActionType t, int stage = 1) const {
    if (auto it = per_stage.find({stage, t}); it != per_stage.end()) return it->second;
    const bool skip = first_stage_skips_input_grad && stage == 0;
    switch (t) {
      case ActionType::kForward:
        return forward;
      case ActionType::kBackward:
        return skip ? backward - backward_input : backward;
      case ActionType::kBackwardInput:
        return skip ? 0 : backward_input;
      case ActionType::kBackwardWeight:
        return backward_weight;
      default:
        return 0;
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
  std::vector<int> peak_activations, peak_recv_buffers, peak_sends_in_flight;
  // Received tensors alive at once: a receive's buffer from its RECV until the backward that last
  // reads it (B, or W after I: a received activation is the stage's input, which its graph may
  // save for the weight gradient; a received gradient is W's input), as the executor keeps them.
  std::vector<int> peak_received;
  double mean_bubble() const {
    double s = 0;
    for (double b : bubble) s += b;
    return bubble.empty() ? 0 : s / bubble.size();
  }
};

// `max_outstanding_sends` > 0 makes a send wait, as the executor does, while that many earlier
// sends of its rank are counted in flight: from the oldest one not yet matched by a posted receive
// on (a send leaves the count only after every older one has); a budget that cannot be kept
// without a deadlock is reported as one.
// A receive that a send under the budget waits for, while its rank is stuck at `stuck_at`.
struct BudgetBlocker {
  int rank;
  Action recv;
  size_t stuck_at;
};

inline SimResult simulate(const Program& program, const std::vector<int>& owner, const Costs& costs = {},
                          int max_outstanding_sends = 0, std::vector<BudgetBlocker>* blockers = nullptr) {
  using T = ActionType;
  using Key = std::tuple<int, int, int>;
  const int ranks = static_cast<int>(program.size()), stages = static_cast<int>(owner.size());
  SimResult res;
  res.spans.resize(ranks);
  res.busy.assign(ranks, 0);
  res.peak_activations.assign(ranks, 0);
  res.peak_recv_buffers.assign(ranks, 0);
  res.peak_sends_in_flight.assign(ranks, 0);
  res.peak_received.assign(ranks, 0);
  std::vector<std::multiset<std::pair<int, int>>> received(ranks);  // (stage, microbatch) per receive
  std::vector<size_t> next(ranks, 0);
  std::vector<double> clock(ranks, 0);
  std::vector<int> live_act(ranks, 0), live_buf(ranks, 0);
  std::map<Key, double> sent, posted;              // send key -> time; receive key -> time posted
  std::vector<std::set<Key>> have(ranks);          // what a rank has computed or posted
  std::vector<std::vector<Key>> in_flight(ranks);  // receive keys of this rank's unmatched sends
  auto key = [](int s, T t, int mb) { return Key{s, static_cast<int>(t), mb}; };
  auto name = [](int s, T t, int mb) { return std::to_string(s) + type_token(t) + std::to_string(mb); };

  struct Block {
    bool error = false;
    std::string why;  // empty: the action can run
  };
  // The data a computation needs from another rank: nullopt when produced on this rank or none.
  auto input_of = [&](int r, const Action& a) -> std::optional<std::pair<Key, Key>> {  // (recv, send)
    if (a.type == T::kForward && a.stage > 0 && !have[r].count(key(a.stage - 1, T::kForward, a.microbatch)))
      return std::pair{key(a.stage, T::kRecvF, a.microbatch), key(a.stage - 1, T::kSendF, a.microbatch)};
    if ((a.type == T::kBackward || a.type == T::kBackwardInput) && a.stage < stages - 1 &&
        !have[r].count(key(a.stage + 1, T::kBackward, a.microbatch)) &&
        !have[r].count(key(a.stage + 1, T::kBackwardInput, a.microbatch)))
      return std::pair{key(a.stage, T::kRecvB, a.microbatch), key(a.stage + 1, T::kSendB, a.microbatch)};
    return std::nullopt;
  };
  // Sends leave a rank's count in the order they were issued, as the executor waits for them: the
  // oldest first (on NCCL a wait is a stream dependency, and a stream can only wait for one given
  // event, not for whichever finishes first).
  auto drop_matched = [&](int r) {
    auto& f = in_flight[r];
    while (!f.empty() && posted.count(f.front())) f.erase(f.begin());
  };
  auto blocked = [&](int r, const Action& a) -> Block {
    const int s = a.stage, mb = a.microbatch;
    switch (a.type) {
      case T::kForward:
      case T::kBackward:
      case T::kBackwardInput: {
        if (a.type != T::kForward && !have[r].count(key(s, T::kForward, mb)))
          return {true, "runs before its forward"};
        if (auto in = input_of(r, a)) {
          const auto& [recv, send] = *in;
          if (!have[r].count(recv))
            return {true, std::string("has no input (no ") + name(s, static_cast<T>(std::get<1>(recv)), mb) +
                              " before it)"};
          if (!sent.count(send))
            return {false, "waits for " + name(std::get<0>(send), static_cast<T>(std::get<1>(send)), mb)};
        }
        return {};
      }
      case T::kBackwardWeight:
        return have[r].count(key(s, T::kBackwardInput, mb)) ? Block{} : Block{true, "runs before its I"};
      case T::kSendF:
      case T::kSendB: {
        if (a.type == T::kSendF
                ? !have[r].count(key(s, T::kForward, mb))
                : !have[r].count(key(s, T::kBackward, mb)) && !have[r].count(key(s, T::kBackwardInput, mb)))
          return {true, "sends before computing what it sends"};
        drop_matched(r);
        if (max_outstanding_sends > 0 && static_cast<int>(in_flight[r].size()) >= max_outstanding_sends) {
          const auto& k = in_flight[r].front();
          return {false, "waits for " + name(std::get<0>(k), static_cast<T>(std::get<1>(k)), std::get<2>(k)) +
                             " to be posted (max_outstanding_sends=" + std::to_string(max_outstanding_sends) +
                             ")"};
        }
        return {};
      }
      case T::kWaitSendF:
      case T::kWaitSendB: {  // until the peer has posted the receive that takes the send
        const bool fwd = a.type == T::kWaitSendF;
        const int to = fwd ? s + 1 : s - 1;
        const T recv = fwd ? T::kRecvF : T::kRecvB;
        return posted.count(key(to, recv, mb))
                   ? Block{}
                   : Block{false, "waits for " + name(to, recv, mb) + " to be posted"};
      }
      default:
        return {};
    }
  };

  for (;;) {
    bool progress = false, finished = true;
    for (int r = 0; r < ranks; ++r) {
      while (next[r] < program[r].size()) {
        const Action& a = program[r][next[r]];
        const Block b = blocked(r, a);
        if (b.error) throw ScheduleError("rank " + std::to_string(r) + ": " + to_string(a) + " " + b.why);
        if (!b.why.empty()) break;
        progress = true;
        double& t = clock[r];
        const int s = a.stage, mb = a.microbatch;
        if (a.type == T::kRecvF || a.type == T::kRecvB) {
          // Posting a receive never blocks; its buffer lives until the computation that uses it.
          posted[key(s, a.type, mb)] = t;
          have[r].insert(key(s, a.type, mb));
          res.peak_recv_buffers[r] = std::max(res.peak_recv_buffers[r], ++live_buf[r]);
          received[r].insert({s, mb});
          res.peak_received[r] = std::max(res.peak_received[r], static_cast<int>(received[r].size()));
        } else if (a.type == T::kSendF || a.type == T::kSendB) {
          // Under the budget, a send first waits until its oldest predecessor was received.
          // (Checked above; sends issued after an unmatched one stay counted until it is matched.)
          drop_matched(r);
          sent[key(s, a.type, mb)] = t;
          const bool fwd = a.type == T::kSendF;
          in_flight[r].push_back(key(fwd ? s + 1 : s - 1, fwd ? T::kRecvF : T::kRecvB, mb));
          res.peak_sends_in_flight[r] =
              std::max(res.peak_sends_in_flight[r], static_cast<int>(in_flight[r].size()));
        } else if (is_send_wait(a.type)) {  // the send leaves the count, wherever it is in it
          const bool fwd = a.type == T::kWaitSendF;
          auto& f = in_flight[r];
          f.erase(std::remove(f.begin(), f.end(), key(fwd ? s + 1 : s - 1, fwd ? T::kRecvF : T::kRecvB, mb)),
                  f.end());
        } else if (is_compute(a.type)) {
          if (auto in = input_of(r, a)) {
            t = std::max(t, sent.at(in->second) + costs.comm);
            --live_buf[r];
          }
          const double d = costs.of(a.type, a.stage);
          res.spans[r].push_back({a, t, t + d});
          t += d;
          res.busy[r] += d;
          have[r].insert(key(s, a.type, mb));
          // Activations live from F until the last backward that needs them (B, or W after I).
          if (a.type == T::kForward)
            res.peak_activations[r] = std::max(res.peak_activations[r], ++live_act[r]);
          if (a.type == T::kBackward || a.type == T::kBackwardWeight) {
            --live_act[r];
            received[r].erase({s, mb});
          }
        }
        ++next[r];
      }
      if (next[r] < program[r].size()) finished = false;
    }
    if (finished) break;
    if (!progress) {
      std::string stuck;
      for (int r = 0; r < ranks; ++r)
        if (next[r] < program[r].size()) {
          const Action& a = program[r][next[r]];
          stuck += (stuck.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " at " +
                   to_string(a) + " " + blocked(r, a).why;
          if (blockers && (a.type == T::kSendF || a.type == T::kSendB) && !in_flight[r].empty()) {
            const auto& k = in_flight[r].front();
            const int q = owner[std::get<0>(k)];
            blockers->push_back(
                {q, {std::get<0>(k), static_cast<T>(std::get<1>(k)), std::get<2>(k)}, next[q]});
          }
        }
      throw ScheduleError("the schedule deadlocks: " + stuck);
    }
  }
  res.makespan = *std::max_element(clock.begin(), clock.end());
  for (int r = 0; r < ranks; ++r) res.bubble.push_back(res.makespan > 0 ? 1 - res.busy[r] / res.makespan : 0);
  return res;
}

}  // namespace fsdpp::pipeline
