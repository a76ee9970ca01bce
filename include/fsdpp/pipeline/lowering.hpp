#pragma once
// Lowering: from each rank's compute actions to the program a rank executes, with the sends and
// receives between stages on different ranks.

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "fsdpp/pipeline/action.hpp"

namespace fsdpp::pipeline {

// stage -> rank, from where each stage's actions appear. Throws when a stage appears on two ranks
// or a stage in [0, num_stages) never appears.
inline std::vector<int> infer_stage_ranks(const Program& program, int num_stages) {
  std::vector<int> owner(num_stages, -1);
  for (int r = 0; r < static_cast<int>(program.size()); ++r)
    for (const auto& a : program[r]) {
      if (a.stage < 0 || a.stage >= num_stages)
        throw ScheduleError("rank " + std::to_string(r) + ": " + to_string(a) + " names stage " +
                            std::to_string(a.stage) + ", but there are " + std::to_string(num_stages) +
                            " stages");
      if (owner[a.stage] >= 0 && owner[a.stage] != r)
        throw ScheduleError("rank " + std::to_string(r) + ": " + to_string(a) + " runs stage " +
                            std::to_string(a.stage) + ", which rank " + std::to_string(owner[a.stage]) +
                            " also runs; a stage lives on one rank");
      owner[a.stage] = r;
    }
  for (int s = 0; s < num_stages; ++s)
    if (owner[s] < 0) throw ScheduleError("stage " + std::to_string(s) + " has no actions on any rank");
  return owner;
}

// Whether `later` consumes what `earlier` produces: its input (the previous stage's output, or
// the next stage's input gradient), its own forward, or its own I.
inline bool depends_on(const Action& later, const Action& earlier) {
  using T = ActionType;
  const bool backward = later.type == T::kBackward || later.type == T::kBackwardInput;
  const bool earlier_backward = earlier.type == T::kBackward || earlier.type == T::kBackwardInput;
  if (later.microbatch != earlier.microbatch) return false;
  if (later.type == T::kForward) return earlier.type == T::kForward && earlier.stage == later.stage - 1;
  if (backward) return (earlier_backward && earlier.stage == later.stage + 1) || earlier.stage == later.stage;
  return later.type == T::kBackwardWeight && earlier.stage == later.stage;
}

// The groups of one rank's actions (Note [overlap groups]): each opens with a computation and holds
// only computations, of different stages, none consuming what another produces; nothing else
// comes between them. Throws ScheduleError naming the rank and the group.
inline void validate_groups(const std::vector<Action>& actions, int rank) {
  for (size_t i = 0; i < actions.size(); ++i) {
    const size_t end = group_end(actions, i);
    const std::string at = "rank " + std::to_string(rank) + ": ";
    if (actions[i].with_previous)  // group_end takes every marked action after a group's first
      throw ScheduleError(at + to_string(actions[i]) +
                          " is marked as in a group but opens the rank's actions");
    if (end == i + 1) continue;
    std::string group;
    for (size_t j = i; j < end; ++j) group += (j > i ? ";" : "(") + to_string(actions[j]);
    group += ")OVERLAP_F_B";
    for (size_t j = i; j < end; ++j) {
      if (!is_compute(actions[j].type))
        throw ScheduleError(at + group + ": a group holds computations only (F, B, I, W)");
      for (size_t k = i; k < j; ++k) {
        if (actions[k].stage == actions[j].stage)
          throw ScheduleError(at + group + ": " + to_string(actions[k]) + " and " + to_string(actions[j]) +
                              " are on one stage; a group's computations run at once, on different stages");
        if (depends_on(actions[j], actions[k]))
          throw ScheduleError(at + group + ": " + to_string(actions[j]) + " needs what " +
                              to_string(actions[k]) + " produces, so they cannot run at once");
      }
    }
    i = end - 1;
  }
}

// Checks a compute-only program: only F/B/I/W; for every stage and microbatch exactly one F and
// either one B or one I and one W; B or I after that F, W after that I, on the stage's rank.
inline void validate_compute(const Program& program, int num_stages, int microbatches) {
  const auto owner = infer_stage_ranks(program, num_stages);
  using Key = std::tuple<int, int, int>;  // stage, type, microbatch
  std::set<Key> seen;
  auto has = [&](int s, ActionType t, int mb) { return seen.count({s, static_cast<int>(t), mb}) > 0; };
  for (int r = 0; r < static_cast<int>(program.size()); ++r)
    for (const auto& a : program[r]) {
      const std::string at = "rank " + std::to_string(r) + ": " + to_string(a);
      if (!is_compute(a.type))
        throw ScheduleError(at + ": a compute schedule holds only F, B, I and W actions");
      if (a.microbatch < 0 || a.microbatch >= microbatches)
        throw ScheduleError(at + ": microbatch " + std::to_string(a.microbatch) + " is outside [0, " +
                            std::to_string(microbatches) + ")");
      if (has(a.stage, a.type, a.microbatch)) throw ScheduleError(at + " appears twice");
      using T = ActionType;
      if ((a.type == T::kBackward || a.type == T::kBackwardInput) && !has(a.stage, T::kForward, a.microbatch))
        throw ScheduleError(at + " comes before its forward " + std::to_string(a.stage) + "F" +
                            std::to_string(a.microbatch));
      if (a.type == T::kBackwardWeight && !has(a.stage, T::kBackwardInput, a.microbatch))
        throw ScheduleError(at + " (W) comes before its input gradient " + std::to_string(a.stage) + "I" +
                            std::to_string(a.microbatch));
      if ((a.type == T::kBackward && has(a.stage, T::kBackwardInput, a.microbatch)) ||
          (a.type == T::kBackwardInput && has(a.stage, T::kBackward, a.microbatch)))
        throw ScheduleError(at + ": microbatch " + std::to_string(a.microbatch) + " of stage " +
                            std::to_string(a.stage) + " has both B and I");
      seen.insert({a.stage, static_cast<int>(a.type), a.microbatch});
    }
  for (int r = 0; r < static_cast<int>(program.size()); ++r) validate_groups(program[r], r);
  for (int s = 0; s < num_stages; ++s)
    for (int mb = 0; mb < microbatches; ++mb) {
      const std::string what = " for microbatch " + std::to_string(mb) + " of stage " + std::to_string(s) +
                               " (rank " + std::to_string(owner[s]) + ")";
      if (!has(s, ActionType::kForward, mb)) throw ScheduleError("no forward" + what);
      const bool b = has(s, ActionType::kBackward, mb), i = has(s, ActionType::kBackwardInput, mb);
      if (!b && !i) throw ScheduleError("no backward" + what);
      if (i && !has(s, ActionType::kBackwardWeight, mb)) throw ScheduleError("no W after the I" + what);
    }
}

// Inserts SEND_F/RECV_F and SEND_B/RECV_B around computations whose neighbour stage is on another
// rank. Ranks advance in turns, each emitting its next action once its input exists (produced on
// the same rank, or sent by the peer); other actions (UNSHARD, REDUCE_GRAD ...) take a turn each,
// as in PyTorch 2.15's _add_send_recv. A send is emitted right after the computation that produced
// the data (after its group); the matching receive with `early_receives` on the receiver's program
// when the send is emitted (2.15's placement, which make_plan uses), or else right before the
// computation that consumes it (what validate_send_recv compares a table with). Throws naming
// every rank's blocked action when the compute order cannot run (a deadlock).
inline Program add_send_recv(const Program& compute, const std::vector<int>& owner,
                             bool early_receives = false) {
  const int ranks = static_cast<int>(compute.size()), stages = static_cast<int>(owner.size());
  Program out(ranks);
  std::vector<size_t> next(ranks, 0);
  using Key = std::tuple<int, int, int>;  // (stage, type, mb)
  std::vector<std::set<Key>> done(ranks), inbox(ranks);
  auto k = [](int s, ActionType t, int mb) { return Key{s, static_cast<int>(t), mb}; };
  using T = ActionType;
  // The receive a computation needs, if its input comes from another rank; nullopt when none.
  auto needed_recv = [&](int r, const Action& a) -> std::optional<Action> {
    if (a.type == T::kForward && a.stage > 0 && owner[a.stage - 1] != r)
      return Action{a.stage, T::kRecvF, a.microbatch};
    if ((a.type == T::kBackward || a.type == T::kBackwardInput) && a.stage < stages - 1 &&
        owner[a.stage + 1] != r)
      return Action{a.stage, T::kRecvB, a.microbatch};
    return std::nullopt;
  };
  auto ready = [&](int r, const Action& a) {
    if (auto recv = needed_recv(r, a))
      return inbox[r].count(k(recv->stage, recv->type, recv->microbatch)) > 0;
    if (a.type == T::kForward && a.stage > 0)
      return done[r].count(k(a.stage - 1, T::kForward, a.microbatch)) > 0;
    if ((a.type == T::kBackward || a.type == T::kBackwardInput) && a.stage < stages - 1)
      return done[r].count(k(a.stage + 1, T::kBackward, a.microbatch)) > 0 ||
             done[r].count(k(a.stage + 1, T::kBackwardInput, a.microbatch)) > 0;
    return true;
  };
  for (;;) {
    bool progress = false, finished = true;
    for (int r = 0; r < ranks; ++r) {
      if (next[r] >= compute[r].size()) continue;
      finished = false;
      const Action a = compute[r][next[r]];
      if (!is_compute(a.type)) {  // UNSHARD / RESHARD: no data dependency
        out[r].push_back(a);
        ++next[r];
        progress = true;
        continue;
      }
      // An overlap group goes whole, once every computation in it can run; its sends follow it.
      const size_t end = group_end(compute[r], next[r]);
      const std::vector<Action> group(compute[r].begin() + next[r], compute[r].begin() + end);
      if (!std::all_of(group.begin(), group.end(), [&](const Action& g) { return ready(r, g); })) continue;
      for (const auto& g : group)
        if (auto recv = needed_recv(r, g); recv && !early_receives) out[r].push_back(*recv);
      for (const auto& g : group) {
        out[r].push_back(g);
        done[r].insert(k(g.stage, g.type, g.microbatch));
      }
      next[r] = end;
      progress = true;
      for (const auto& g : group) {
        if (g.type == T::kForward && g.stage + 1 < stages && owner[g.stage + 1] != r) {
          out[r].push_back({g.stage, T::kSendF, g.microbatch});
          inbox[owner[g.stage + 1]].insert(k(g.stage + 1, T::kRecvF, g.microbatch));
          if (early_receives) out[owner[g.stage + 1]].push_back({g.stage + 1, T::kRecvF, g.microbatch});
        }
        if ((g.type == T::kBackward || g.type == T::kBackwardInput) && g.stage > 0 &&
            owner[g.stage - 1] != r) {
          out[r].push_back({g.stage, T::kSendB, g.microbatch});
          inbox[owner[g.stage - 1]].insert(k(g.stage - 1, T::kRecvB, g.microbatch));
          if (early_receives) out[owner[g.stage - 1]].push_back({g.stage - 1, T::kRecvB, g.microbatch});
        }
      }
    }
    if (finished) return out;
    if (!progress) {
      std::string stuck;
      for (int r = 0; r < ranks; ++r)
        if (next[r] < compute[r].size())
          stuck += (stuck.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " at " +
                   to_string(compute[r][next[r]]) + " (its input has not been produced)";
      throw ScheduleError("the schedule deadlocks: " + stuck);
    }
  }
}

// Note [point-to-point order]
// NCCL has no tags: between two ranks, on one communicator, the k-th receive a rank posts gets the
// k-th message its peer sends. The executor gives each directed pair of ranks its own communicator,
// so a lowered program is correct on NCCL only if, for every pair (a, b), the messages a sends to b
// in program order are the ones b receives from a, in the same order. Gloo's tags would forgive a
// mismatch; the plan does not rely on them, so that every schedule runs on both backends and can be
// captured in a CUDA graph.
//
// A receive placed late (defer_receives, or add_send_recv without early receives), right before the
// computation that consumes it, is not always in the order the peer sends: a zero-bubble rank may
// run I of microbatch 3 before the backward of microbatch 2 reaches its peer. order_receives() then
// posts such a receive earlier,
// right before the receive of the message its peer sends next. Posting a receive earlier never
// blocks anything (a receive waits on the device, not in the program); it only keeps its buffer
// alive longer. make_plan checks the result for every schedule, and a table that places its own
// sends and receives (a lowered table) is refused when it breaks the order.

// The receive that takes a send's message, and the send a receive takes; nullopt for other actions.
inline std::optional<Action> matching_recv(const Action& send) {
  if (send.type == ActionType::kSendF) return Action{send.stage + 1, ActionType::kRecvF, send.microbatch};
  if (send.type == ActionType::kSendB) return Action{send.stage - 1, ActionType::kRecvB, send.microbatch};
  return std::nullopt;
}
inline std::optional<Action> matching_send(const Action& recv) {
  if (recv.type == ActionType::kRecvF) return Action{recv.stage - 1, ActionType::kSendF, recv.microbatch};
  if (recv.type == ActionType::kRecvB) return Action{recv.stage + 1, ActionType::kSendB, recv.microbatch};
  return std::nullopt;
}

namespace detail {

// "line 2, column 5: 1RECV_F0" for an action of a table read from a file, "rank 1: 1RECV_F0"
// otherwise.
inline std::string action_at(const Program& program, int rank, size_t index, const Positions* where) {
  const std::string a = to_string(program[rank][index]);
  if (where && rank < static_cast<int>(where->size()) && index < (*where)[rank].size())
    return (*where)[rank][index] + ": " + a;
  return "rank " + std::to_string(rank) + ": " + a;
}

}  // namespace detail

// Throws a ScheduleError naming the first pair of ranks whose sends and receives disagree, and the
// first message where they do. `where` (optional) gives each action's place in a table file.
inline void check_point_to_point_order(const Program& lowered, const std::vector<int>& owner,
                                       const Positions* where = nullptr) {
  const int ranks = static_cast<int>(lowered.size());
  struct Message {
    Action send;   // what the message is, named by the action that sends it
    size_t index;  // where this side moves it
  };
  std::vector<std::vector<std::vector<Message>>> sent(ranks, std::vector<std::vector<Message>>(ranks)),
      received(ranks, std::vector<std::vector<Message>>(ranks));
  for (int r = 0; r < ranks; ++r)
    for (size_t i = 0; i < lowered[r].size(); ++i) {
      const Action& a = lowered[r][i];
      if (const auto recv = matching_recv(a)) sent[r][owner.at(recv->stage)].push_back({a, i});
      if (const auto send = matching_send(a)) received[owner.at(send->stage)][r].push_back({*send, i});
    }
  for (int a = 0; a < ranks; ++a)
    for (int b = 0; b < ranks; ++b) {
      const auto &out = sent[a][b], &in = received[a][b];
      for (size_t k = 0; k < std::max(out.size(), in.size()); ++k) {
        if (k < out.size() && k < in.size() && out[k].send == in[k].send) continue;
        const std::string send = k < out.size() ? detail::action_at(lowered, a, out[k].index, where)
                                                : "rank " + std::to_string(a) + " sends nothing";
        const std::string recv = k < in.size() ? detail::action_at(lowered, b, in[k].index, where) +
                                                     " (the message of " + to_string(in[k].send) + ")"
                                               : "rank " + std::to_string(b) + " receives nothing";
        throw ScheduleError(
            "rank " + std::to_string(a) + " -> rank " + std::to_string(b) + ": message " +
            std::to_string(k + 1) + " is " + send + " but " + recv +
            "; sends and receives between two ranks must come in the same order (NCCL matches "
            "them by order, not tag)");
      }
    }
}

// Moves receives earlier until, for every pair of ranks, they come in the order the peer sends;
// see Note [point-to-point order]. Receives whose send is missing are left alone (the validators
// name them).
inline void order_receives(Program& lowered, const std::vector<int>& owner) {
  const int ranks = static_cast<int>(lowered.size());
  for (int from = 0; from < ranks; ++from) {
    std::vector<std::vector<Action>> messages(ranks);  // the receives of `from`'s sends, per receiver
    for (const auto& a : lowered[from])
      if (const auto recv = matching_recv(a)) messages[owner.at(recv->stage)].push_back(*recv);
    for (int to = 0; to < ranks; ++to) {
      auto& p = lowered[to];
      const auto& seq = messages[to];
      // Backwards: once the receives of later messages are in order, the receive of message k
      // goes right before that of message k + 1 when it came after it.
      for (size_t k = seq.size(); k-- > 1;) {
        const auto here = std::find(p.begin(), p.end(), seq[k - 1]),
                   next = std::find(p.begin(), p.end(), seq[k]);
        if (here == p.end() || next == p.end() || here < next) continue;
        const auto at = next - p.begin();
        const Action recv = *here;
        p.erase(here);
        p.insert(p.begin() + at, recv);
      }
    }
  }
}

// Receives posted late, as PyTorch 2.15's `_defer_recv_ops` moves them (its `defer_pp_recv`):
// from a program whose receives are posted early, each receive moves down to just before the
// computation that consumes it (before its group), except that a rank sending to a higher-numbered
// peer first posts the receives from that peer it has deferred, so that of two ranks the lower
// always receives first and neither waits on the other's send. order_receives then restores the
// peers' send order where moving a receive broke it (Note [point-to-point order]).
inline Program defer_receives(const Program& lowered, const std::vector<int>& owner) {
  using T = ActionType;
  Program out(lowered.size());
  for (int r = 0; r < static_cast<int>(lowered.size()); ++r) {
    std::vector<Action> deferred;  // in the order they were posted
    auto flush = [&](auto&& which) {
      for (auto it = deferred.begin(); it != deferred.end();)
        if (which(*it)) {
          out[r].push_back(*it);
          it = deferred.erase(it);
        } else {
          ++it;
        }
    };
    const auto& p = lowered[r];
    for (size_t i = 0; i < p.size(); ++i) {
      const Action& a = p[i];
      if (matching_send(a)) {
        deferred.push_back(a);
        continue;
      }
      if (const auto recv = matching_recv(a); recv && r < owner.at(recv->stage)) {
        const int peer = owner.at(recv->stage);
        flush([&](const Action& d) { return owner.at(matching_send(d)->stage) == peer; });
      }
      if (is_compute(a.type) && !a.with_previous)
        for (size_t j = i; j < group_end(p, i); ++j) {
          const Action& c = p[j];
          const T type = c.type == T::kForward ? T::kRecvF : T::kRecvB;
          if (c.type != T::kBackwardWeight)
            flush([&](const Action& d) { return d == Action{c.stage, type, c.microbatch}; });
        }
      out[r].push_back(a);
    }
    if (!deferred.empty())
      throw ScheduleError("rank " + std::to_string(r) + ": " + to_string(deferred.front()) +
                          " is never consumed by a computation");
  }
  return out;
}

// Checks the sends and receives of a program that places its own (a lowered table): exactly those
// its computations need, each once: a SEND_F after each forward whose next stage is on another
// rank, a RECV_F on that rank, and likewise SEND_B/RECV_B for input gradients. Where they sit is
// checked by the simulator; their order between two ranks by check_point_to_point_order.
inline void validate_send_recv(const Program& lowered, const std::vector<int>& owner,
                               const Positions* where = nullptr) {
  using T = ActionType;
  const int ranks = static_cast<int>(lowered.size()), stages = static_cast<int>(owner.size());
  Program compute(ranks);
  for (int r = 0; r < ranks; ++r)
    for (const auto& a : lowered[r])
      if (!matching_recv(a) && !matching_send(a) && !is_send_wait(a.type)) compute[r].push_back(a);
  const Program needed = add_send_recv(compute, owner);
  for (int r = 0; r < ranks; ++r) {
    std::vector<Action> need;
    for (const auto& a : needed[r])
      if (matching_recv(a) || matching_send(a)) need.push_back(a);
    std::vector<Action> seen;
    for (size_t i = 0; i < lowered[r].size(); ++i) {
      const Action& a = lowered[r][i];
      const auto peer = matching_recv(a) ? matching_recv(a) : matching_send(a);
      if (!peer) continue;
      const std::string at = detail::action_at(lowered, r, i, where);
      if (peer->stage < 0 || peer->stage >= stages)
        throw ScheduleError(at + ": stage " + std::to_string(a.stage) + " has no " +
                            (a.type == T::kSendF || a.type == T::kRecvB ? "next" : "previous") +
                            " stage to talk to");
      if (std::find(seen.begin(), seen.end(), a) != seen.end()) throw ScheduleError(at + " appears twice");
      seen.push_back(a);
      if (std::find(need.begin(), need.end(), a) == need.end())
        throw ScheduleError(at + " is not needed: stage " + std::to_string(peer->stage) + " is on rank " +
                            std::to_string(owner[peer->stage]) +
                            (owner[peer->stage] == r ? ", this rank, so the data does not travel" : ""));
    }
    for (const auto& a : need)
      if (std::find(seen.begin(), seen.end(), a) == seen.end()) {
        const bool send = matching_recv(a).has_value();
        const bool forward = a.type == T::kSendF || a.type == T::kRecvF;
        const std::string data = std::to_string(a.stage) + (forward ? "F" : "B") +
                                 std::to_string(a.microbatch) + (forward ? "" : " (or I)");
        const int peer = owner[(send ? *matching_recv(a) : *matching_send(a)).stage];
        throw ScheduleError("rank " + std::to_string(r) + " has no " + to_string(a) + ": " +
                            (send ? "the output of " + data + " goes to rank "
                                  : "the input of " + data + " comes from rank ") +
                            std::to_string(peer));
      }
  }
}

// How far ahead each pipeline rank gathers its FSDP stages, as PyTorch 2.15's `unshard_lookahead`:
// "full" gathers every stage it keeps resident as soon as it enters the residency window
// (`max_active_stages` ahead); "auto" gathers min(rank + 2, max_active_stages) stages ahead, so
// that rank 0 starts with its current and next stage and each later rank, which waits longer in the
// start-up bubble, one more; per_rank gives each rank its own distance.
struct UnshardLookahead {
  enum class Policy { kFull, kAuto, kPerRank };
  Policy policy = Policy::kFull;
  std::vector<int> per_rank;  // kPerRank: one value per pipeline rank

  // "full", "auto" or comma-separated integers ("1,2,3"); throws ScheduleError otherwise.
  static UnshardLookahead parse(const std::string& text) {
    if (text == "full") return {};
    if (text == "auto") return {Policy::kAuto, {}};
    UnshardLookahead l{Policy::kPerRank, {}};
    size_t pos = 0;
    while (pos <= text.size()) {
      const size_t comma = std::min(text.find(',', pos), text.size());
      const std::string item = text.substr(pos, comma - pos);
      if (item.empty() || item.size() > 4 || item.find_first_not_of("0123456789") != std::string::npos)
        throw ScheduleError("unshard lookahead must be full, auto or integers separated by commas, got '" +
                            text + "'");
      l.per_rank.push_back(std::stoi(item));
      pos = comma + 1;
    }
    return l;
  }
};

inline std::string to_string(const UnshardLookahead& l) {
  if (l.policy == UnshardLookahead::Policy::kFull) return "full";
  if (l.policy == UnshardLookahead::Policy::kAuto) return "auto";
  std::string out;
  for (int v : l.per_rank) out += (out.empty() ? "" : ",") + std::to_string(v);
  return out;
}

// One lookahead per pipeline rank, each in [1, max_active_stages] (PyTorch's
// `_resolve_unshard_lookahead`). Throws ScheduleError naming the rank and value.
inline std::vector<int> resolve_unshard_lookahead(const UnshardLookahead& l, int pp, int max_active_stages) {
  if (max_active_stages < 1)
    throw ScheduleError("max_active_stages must be at least 1 (the stage being computed), got " +
                        std::to_string(max_active_stages));
  std::vector<int> out(static_cast<size_t>(pp), max_active_stages);
  if (l.policy == UnshardLookahead::Policy::kAuto)
    for (int r = 0; r < pp; ++r) out[r] = std::min(r + 2, max_active_stages);
  if (l.policy != UnshardLookahead::Policy::kPerRank) return out;
  if (static_cast<int>(l.per_rank.size()) != pp)
    throw ScheduleError("unshard lookahead needs one value per pipeline rank (" + std::to_string(pp) +
                        "), got " + std::to_string(l.per_rank.size()));
  for (int r = 0; r < pp; ++r)
    if (l.per_rank[r] < 1 || l.per_rank[r] > max_active_stages)
      throw ScheduleError("unshard lookahead of rank " + std::to_string(r) +
                          " must be in [1, max_active_stages=" + std::to_string(max_active_stages) +
                          "], got " + std::to_string(l.per_rank[r]));
  return l.per_rank;
}

// For FSDP stages, as PyTorch 2.15's lowering does (`_add_unshard_reshard`): before each compute
// action, the next `max_active_stages` distinct stages this rank computes (the current one first)
// stay gathered and stages outside them are resharded; of those, the next `lookahead[rank]` are
// gathered if they are not yet (UNSHARD issued ahead of use, so a rank's gathers spread over its
// start-up bubble). Everything still gathered is resharded at the end. An empty `lookahead` is
// `max_active_stages` on every rank; resolve_unshard_lookahead makes one from a policy.
inline Program add_unshard_reshard(const Program& compute, int max_active_stages = 3,
                                   const std::vector<int>& lookahead = {}) {
  Program out(compute.size());
  for (size_t r = 0; r < compute.size(); ++r) {
    const auto& p = compute[r];
    // The next `count` distinct stages from action i on, the current first. An overlap group counts
    // whole: all its stages, even past `count` (as in 2.15).
    auto next_stages = [&](size_t i, size_t count) {
      std::vector<int> stages;
      for (size_t j = i; j < p.size() && stages.size() < count;) {
        const size_t end = group_end(p, j);
        for (; j < end; ++j)
          if (std::find(stages.begin(), stages.end(), p[j].stage) == stages.end())
            stages.push_back(p[j].stage);
      }
      return stages;
    };
    const auto ahead = static_cast<size_t>(
        std::min(r < lookahead.size() ? lookahead[r] : max_active_stages, max_active_stages));
    std::vector<int> active;  // in the order gathered, which is the order resharded at the end
    for (size_t i = 0; i < p.size();) {
      const size_t end = group_end(p, i);
      if (end - i > static_cast<size_t>(max_active_stages))
        throw ScheduleError("rank " + std::to_string(r) + ": the group at " + to_string(p[i]) + " computes " +
                            std::to_string(end - i) + " stages at once, more than max_active_stages (" +
                            std::to_string(max_active_stages) + ")");
      const auto resident = next_stages(i, static_cast<size_t>(max_active_stages));
      for (auto it = active.begin(); it != active.end();) {
        if (std::find(resident.begin(), resident.end(), *it) == resident.end()) {
          out[r].push_back({*it, ActionType::kReshard, -1});
          it = active.erase(it);
        } else {
          ++it;
        }
      }
      for (int s : next_stages(i, ahead))
        if (std::find(active.begin(), active.end(), s) == active.end()) {
          out[r].push_back({s, ActionType::kUnshard, -1});
          active.push_back(s);
        }
      out[r].insert(out[r].end(), p.begin() + i, p.begin() + end);
      i = end;
    }
    for (int s : active) out[r].push_back({s, ActionType::kReshard, -1});
  }
  return out;
}

// Moves `recv` in `rank`'s program to position `to` (earlier): posting a receive sooner is always
// allowed; it only keeps its buffer alive longer.
inline void hoist_recv(Program& program, int rank, const Action& recv, size_t to) {
  auto& p = program[rank];
  while (to > 0 && to < p.size() && p[to].with_previous) --to;  // before the group, not inside it
  auto it = std::find(p.begin(), p.end(), recv);
  if (it == p.end() || static_cast<size_t>(it - p.begin()) <= to) return;
  p.erase(it);
  p.insert(p.begin() + to, recv);
}

// After each stage's last backward (B or W), its REDUCE_GRAD (for FSDP stages), and a
// WAIT_REDUCE_GRAD for each, as PyTorch 2.15's _add_reduce_grad places them: right after it, or
// with `defer_wait`, before the rank's next REDUCE_GRAD or at the end, so that the reduction
// overlaps the computations in between (at most one pending per rank).
// The input gradient's send, when it directly follows, goes first: it is on the critical path.
inline Program add_reduce_grad(const Program& program, int microbatches, bool defer_wait = false) {
  Program out(program.size());
  for (size_t r = 0; r < program.size(); ++r) {
    std::map<int, int> count;
    std::optional<int> pending;
    const auto& p = program[r];
    for (size_t i = 0; i < p.size();) {
      // A group goes whole; the stages whose last backward is in it are reduced after it.
      const size_t end = group_end(p, i);
      std::vector<int> finished;
      for (; i < end; ++i) {
        out[r].push_back(p[i]);
        if ((p[i].type == ActionType::kBackward || p[i].type == ActionType::kBackwardWeight) &&
            ++count[p[i].stage] == microbatches)
          finished.push_back(p[i].stage);
      }
      if (finished.empty()) continue;
      while (i < p.size() && p[i].type == ActionType::kSendB &&
             std::find(finished.begin(), finished.end(), p[i].stage) != finished.end())
        out[r].push_back(p[i++]);
      for (int stage : finished) {
        if (pending) out[r].push_back({*pending, ActionType::kWaitReduceGrad, -1});
        out[r].push_back({stage, ActionType::kReduceGrad, -1});
        if (defer_wait)
          pending = stage;
        else
          out[r].push_back({stage, ActionType::kWaitReduceGrad, -1});
      }
    }
    if (pending) out[r].push_back({*pending, ActionType::kWaitReduceGrad, -1});
  }
  return out;
}

// Every REDUCE_GRAD is waited by a later WAIT_REDUCE_GRAD of its stage, before that stage's next
// REDUCE_GRAD, and a rank has at most one reduction pending at a time (as PyTorch 2.15 requires);
// a wait without its reduction is refused too. Throws ScheduleError naming the rank and action.
inline void validate_reduce_waits(const Program& program) {
  for (size_t r = 0; r < program.size(); ++r) {
    std::optional<int> pending;
    const auto where = [&](const Action& a) {
      return "rank " + std::to_string(r) + ", " + to_string(a) + ": ";
    };
    for (const auto& a : program[r]) {
      if (a.type == ActionType::kReduceGrad) {
        if (pending)
          throw ScheduleError(
              where(a) + "stage " + std::to_string(*pending) +
              "'s REDUCE_GRAD is still pending (one at a time; add its WAIT_REDUCE_GRAD first)");
        pending = a.stage;
      } else if (a.type == ActionType::kWaitReduceGrad) {
        if (pending != a.stage) throw ScheduleError(where(a) + "waits for a REDUCE_GRAD that is not pending");
        pending.reset();
      }
    }
    if (pending)
      throw ScheduleError("rank " + std::to_string(r) + ": " + std::to_string(*pending) +
                          "REDUCE_GRAD is never waited (add " + std::to_string(*pending) +
                          "WAIT_REDUCE_GRAD)");
  }
}

}  // namespace fsdpp::pipeline

#include "fsdpp/pipeline/send_waits.hpp"  // the passes over send waits, which build on these
