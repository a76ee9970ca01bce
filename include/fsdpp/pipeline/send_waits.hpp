#pragma once
// Send waits: PyTorch 2.15's WAIT_SEND_F / WAIT_SEND_B, where the lowering places them, their
// check, and the send budget placed with them.
//
// The send budget in the plan, as 2.15's `_add_wait_send_budget` places it: before a send that
// would put more than `max_outstanding_sends` of its rank's sends in flight, one of the pending
// sends' waits moves up to just before it, so that the program itself never has more sends
// unwaited than the budget. Which wait moves is decided on a dependency graph of the lowered
// program: each rank's actions in order, each send before its receive, and each receive before the
// action that follows its send's wait (a wait completes once the peer has posted the receive).
// Moving a send's wait before an action X is safe when the receive does not depend on X (otherwise
// the program would wait on itself); among the safe ones a wait whose receive is already bound to
// come before X (it cannot stall) is preferred, and among equals the oldest send. When no pending
// wait can move safely the budget cannot be kept, and the error names the rank, the send and the
// sends in flight.

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fsdpp/pipeline/lowering.hpp"

namespace fsdpp::pipeline {

// One WAIT_SEND_F / WAIT_SEND_B for every send, as PyTorch 2.15's _add_wait_send places them: a
// forward output's send is waited right after this rank's backward (B or I) of the same stage and
// microbatch, which could not have run unless the peer had consumed that output; every other send
// (input gradients, and outputs whose backward this rank never runs) at the end of the program, in
// the order they were sent. The executor also waits for the oldest send when the plan's
// max_outstanding_sends are in flight; a wait finds such a send done.
inline Program add_send_waits(const Program& program) {
  Program out(program.size());
  for (size_t r = 0; r < program.size(); ++r) {
    std::vector<Action> pending;  // sends in the order they were issued
    const auto& p = program[r];
    for (size_t i = 0; i < p.size();) {
      const size_t end = group_end(p, i);  // a group's waits follow it
      out[r].insert(out[r].end(), p.begin() + i, p.begin() + end);
      for (; i < end; ++i) {
        const Action& a = p[i];
        if (send_wait(a)) pending.push_back(a);
        if (a.type != ActionType::kBackward && a.type != ActionType::kBackwardInput) continue;
        const Action output{a.stage, ActionType::kSendF, a.microbatch};
        if (const auto it = std::find(pending.begin(), pending.end(), output); it != pending.end()) {
          out[r].push_back(*send_wait(output));
          pending.erase(it);
        }
      }
    }
    for (const auto& send : pending) out[r].push_back(*send_wait(send));
  }
  return out;
}

inline bool has_send_waits(const Program& program) {
  for (const auto& rank : program)
    for (const auto& a : rank)
      if (is_send_wait(a.type)) return true;
  return false;
}

// Every send is waited exactly once, by a later WAIT_SEND_F / WAIT_SEND_B of this rank, and every
// wait has its send before it (PyTorch 2.15's _validate_send_waits). Throws ScheduleError naming
// the action (by its place in a table file when `where` is given).
inline void validate_send_waits(const Program& program, const Positions* where = nullptr) {
  for (size_t r = 0; r < program.size(); ++r) {
    std::vector<Action> pending;
    for (size_t i = 0; i < program[r].size(); ++i) {
      const Action& a = program[r][i];
      if (send_wait(a)) pending.push_back(a);
      if (const auto send = waited_send(a)) {
        const auto it = std::find(pending.begin(), pending.end(), *send);
        if (it == pending.end())
          throw ScheduleError(detail::action_at(program, int(r), i, where) + " waits for " +
                              to_string(*send) +
                              ", which this rank has not sent before it (or whose wait came earlier)");
        pending.erase(it);
      }
    }
    if (!pending.empty())
      throw ScheduleError("rank " + std::to_string(r) + ": " + to_string(pending.front()) +
                          " is never waited (add " + to_string(*send_wait(pending.front())) + " after it)");
  }
}

// The send budget placed in the plan (see the top of this file). Throws ScheduleError where it
// cannot be kept.
inline Program add_send_budget_waits(const Program& program, const std::vector<int>& owner,
                                     int max_outstanding_sends) {
  using T = ActionType;
  using Key = std::tuple<int, int, int>;  // (type, stage, microbatch) of a send
  auto key_of = [](const Action& a) { return Key{static_cast<int>(a.type), a.stage, a.microbatch}; };
  const int ranks = static_cast<int>(program.size());
  // Nodes: every action but the waits, which are the constraints being moved.
  std::vector<Action> node_action;
  std::vector<std::vector<int>> node_of(ranks), rank_nodes(ranks);
  std::map<Key, int> send_node;
  std::map<std::pair<int, Key>, int> recv_node;  // (rank, receive's key) -> node
  for (int r = 0; r < ranks; ++r)
    for (const Action& a : program[r]) {
      if (is_send_wait(a.type)) {
        node_of[r].push_back(-1);
        continue;
      }
      const int n = static_cast<int>(node_action.size());
      node_action.push_back(a);
      node_of[r].push_back(n);
      rank_nodes[r].push_back(n);
      if (a.type == T::kSendF || a.type == T::kSendB) send_node[key_of(a)] = n;
      if (a.type == T::kRecvF || a.type == T::kRecvB) recv_node[{r, key_of(a)}] = n;
    }
  std::map<Key, int> receive;  // send -> the node of its receive
  for (const auto& [key, node] : send_node) {
    const Action recv = *matching_recv(node_action[node]);
    const auto it = recv_node.find({owner.at(recv.stage), key_of(recv)});
    if (it == recv_node.end())
      throw ScheduleError(to_string(node_action[node]) + " has no matching receive (max_outstanding_sends)");
    receive[key] = it->second;
  }
  std::map<Key, std::optional<int>> wait_before;  // send -> the node after its wait (none: the end)
  for (int r = 0; r < ranks; ++r) {
    std::optional<int> next;
    for (size_t i = program[r].size(); i-- > 0;) {
      if (node_of[r][i] >= 0) {
        next = node_of[r][i];
      } else {
        wait_before[key_of(*waited_send(program[r][i]))] = next;
      }
    }
  }
  const int nodes = static_cast<int>(node_action.size());
  std::vector<std::map<int, int>> edges(nodes);  // node -> successors, with multiplicity
  auto add_edge = [&](int from, int to) { ++edges[from][to]; };
  auto remove_edge = [&](int from, int to) {
    if (--edges[from][to] == 0) edges[from].erase(to);
  };
  auto reachable = [&](int from, int to) {
    if (from == to) return true;
    std::vector<int> stack{from};
    std::vector<char> seen(nodes, 0);
    seen[from] = 1;
    while (!stack.empty()) {
      const int n = stack.back();
      stack.pop_back();
      for (const auto& [next, count] : edges[n]) {
        if (next == to) return true;
        if (!seen[next]) seen[next] = 1, stack.push_back(next);
      }
    }
    return false;
  };
  for (int r = 0; r < ranks; ++r)
    for (size_t i = 1; i < rank_nodes[r].size(); ++i) add_edge(rank_nodes[r][i - 1], rank_nodes[r][i]);
  for (const auto& [key, node] : send_node) add_edge(node, receive.at(key));
  for (const auto& [key, before] : wait_before)
    if (before) add_edge(receive.at(key), *before);
  {  // the program as given must be free of cycles (Kahn's algorithm)
    std::vector<int> in(nodes, 0), ready;
    for (int n = 0; n < nodes; ++n)
      for (const auto& [next, count] : edges[n]) in[next] += count;
    for (int n = 0; n < nodes; ++n)
      if (!in[n]) ready.push_back(n);
    int walked = 0;
    while (!ready.empty()) {
      const int n = ready.back();
      ready.pop_back();
      ++walked;
      for (const auto& [next, count] : edges[n])
        if ((in[next] -= count) == 0) ready.push_back(next);
    }
    if (walked != nodes) throw ScheduleError("pipeline sends, receives and their waits form a cycle");
  }
  // Whether moving `send`'s wait before `before` is safe, and whether it cannot stall there.
  auto classify = [&](const Key& send, int before) {
    const int recv = receive.at(send);
    const auto old = wait_before.at(send);
    if (old) remove_edge(recv, *old);
    const bool safe = !reachable(before, recv);
    const bool no_stall = safe && reachable(recv, before);
    if (old) add_edge(recv, *old);
    return std::pair{safe, no_stall};
  };
  Program out(ranks);
  std::vector<Key> moved;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::pair<Key, Action>> pending;  // sends without their wait yet, oldest first
    for (size_t i = 0; i < program[r].size(); ++i) {
      const Action& a = program[r][i];
      if (a.type == T::kSendF || a.type == T::kSendB) {
        const int before = node_of[r][i];
        while (static_cast<int>(pending.size()) >= max_outstanding_sends) {
          std::optional<size_t> no_stall, may_stall;
          for (size_t k = 0; k < pending.size(); ++k) {
            const auto [safe, completes] = classify(pending[k].first, before);
            if (completes && !no_stall) no_stall = k;
            if (safe && !completes && !may_stall) may_stall = k;
          }
          const auto pick = no_stall ? no_stall : may_stall;
          if (!pick) {
            std::string outstanding;
            for (const auto& [k, send] : pending)
              outstanding += (outstanding.empty() ? "" : ", ") + to_string(send);
            throw ScheduleError(
                "max_outstanding_sends=" + std::to_string(max_outstanding_sends) +
                " cannot be kept on rank " + std::to_string(r) + " before " + to_string(a) +
                ": no wait of the sends in flight (" + outstanding +
                ") can come earlier without the program waiting on itself; raise the budget or "
                "change the schedule");
          }
          const auto [send_key, send] = pending[*pick];
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(*pick));
          const int recv = receive.at(send_key);
          if (const auto old = wait_before.at(send_key)) remove_edge(recv, *old);
          add_edge(recv, before);
          wait_before[send_key] = before;
          moved.push_back(send_key);
          out[r].push_back(*send_wait(send));
        }
        out[r].push_back(a);
        pending.emplace_back(key_of(a), a);
      } else if (const auto send = waited_send(a)) {
        const Key k = key_of(*send);
        if (const auto it = std::find(moved.begin(), moved.end(), k); it != moved.end()) {
          moved.erase(it);  // already placed earlier
        } else {
          out[r].push_back(a);
          for (auto it2 = pending.begin(); it2 != pending.end(); ++it2)
            if (it2->first == k) {
              pending.erase(it2);
              break;
            }
        }
      } else {
        out[r].push_back(a);
      }
    }
  }
  return out;
}

}  // namespace fsdpp::pipeline
