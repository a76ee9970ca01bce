#pragma once
// The action IR of a pipeline schedule, and its text form.
//
// A schedule is a list of actions per pipeline rank, executed in order. An action is written
// "<stage><TYPE><microbatch>", compatible with PyTorch's pipelining: "0F1" (stage 0 forward of
// microbatch 1), "2I1", "0W3", "0B3", "1UNSHARD", "2SEND_B2", "1RECV_F1", "0WAIT_SEND_F1",
// "0REDUCE_GRAD", "0WAIT_REDUCE_GRAD". A CSV
// holds one rank per row, one action per cell; an empty cell is an idle slot and is skipped.
//
// Note [overlap groups]
// PyTorch 2.15's OVERLAP_F_B: computations of different stages, written "(0F1;3B0)OVERLAP_F_B",
// meant to overlap so that one's communication hides behind the other's compute (DualPipeV pairs
// the forward of one stage with the backward of the other). Here a group is its actions in order,
// each after the first marked `with_previous`: every pass that does not care sees plain actions,
// and the passes that do keep a group whole (nothing is placed between its actions; its sends
// follow it, as 2.15 lowers it). The executor runs first whichever computation has its input,
// and issues each one's sends as soon as it is done (executor.hpp). A group's actions must be
// independent: different stages, none consuming what another produces (validate_groups).

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdpp::pipeline {

enum class ActionType {
  kForward,         // F
  kBackward,        // B: input and weight gradients together
  kBackwardInput,   // I: input gradient only (zero-bubble schedules)
  kBackwardWeight,  // W: weight gradient of an earlier I
  kSendF,
  kRecvF,
  kSendB,
  kRecvB,
  kUnshard,
  kReshard,
  kReduceGrad,
  kWaitReduceGrad,  // waits for the stage's REDUCE_GRAD (PyTorch 2.15's WAIT_REDUCE_GRAD)
  kWaitSendF,       // waits for this rank's SEND_F of the same stage and microbatch (WAIT_SEND_F)
  kWaitSendB,       // likewise for a SEND_B (WAIT_SEND_B)
  // OVERLAP_F_B names a whole overlap group (Note [overlap groups]) where an API takes a type
  // (PipelineExecutor::register_custom_function); a program holds the group's own actions.
  kOverlapFB,
};

struct Action {
  int stage = 0;
  ActionType type = ActionType::kForward;
  int microbatch = -1;  // -1 for UNSHARD, RESHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD
  // In an OVERLAP_F_B group with the computation before it (Note [overlap groups]).
  bool with_previous = false;

  bool operator==(const Action&) const = default;
};

// One list of actions per pipeline rank.
using Program = std::vector<std::vector<Action>>;

// A malformed or invalid schedule. The message names the rank (or line and column) and action.
class ScheduleError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline const char* type_token(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return "F";
    case ActionType::kBackward:
      return "B";
    case ActionType::kBackwardInput:
      return "I";
    case ActionType::kBackwardWeight:
      return "W";
    case ActionType::kSendF:
      return "SEND_F";
    case ActionType::kRecvF:
      return "RECV_F";
    case ActionType::kSendB:
      return "SEND_B";
    case ActionType::kRecvB:
      return "RECV_B";
    case ActionType::kUnshard:
      return "UNSHARD";
    case ActionType::kReshard:
      return "RESHARD";
    case ActionType::kReduceGrad:
      return "REDUCE_GRAD";
    case ActionType::kWaitReduceGrad:
      return "WAIT_REDUCE_GRAD";
    case ActionType::kWaitSendF:
      return "WAIT_SEND_F";
    case ActionType::kWaitSendB:
      return "WAIT_SEND_B";
    case ActionType::kOverlapFB:
      return "OVERLAP_F_B";
  }
  return "?";
}

inline bool is_compute(ActionType t) {
  return t == ActionType::kForward || t == ActionType::kBackward || t == ActionType::kBackwardInput ||
         t == ActionType::kBackwardWeight;
}

inline bool is_send_recv(ActionType t) {
  return t == ActionType::kSendF || t == ActionType::kRecvF || t == ActionType::kSendB ||
         t == ActionType::kRecvB;
}

inline bool is_send_wait(ActionType t) { return t == ActionType::kWaitSendF || t == ActionType::kWaitSendB; }

// The send a WAIT_SEND_F / WAIT_SEND_B waits for, and the wait of a send; nullopt for other actions.
inline std::optional<Action> waited_send(const Action& wait) {
  if (!is_send_wait(wait.type)) return std::nullopt;
  return Action{wait.stage, wait.type == ActionType::kWaitSendF ? ActionType::kSendF : ActionType::kSendB,
                wait.microbatch};
}
inline std::optional<Action> send_wait(const Action& send) {
  if (send.type != ActionType::kSendF && send.type != ActionType::kSendB) return std::nullopt;
  return Action{send.stage, send.type == ActionType::kSendF ? ActionType::kWaitSendF : ActionType::kWaitSendB,
                send.microbatch};
}

inline bool has_microbatch(ActionType t) {
  return t != ActionType::kUnshard && t != ActionType::kReshard && t != ActionType::kReduceGrad &&
         t != ActionType::kWaitReduceGrad;
}

inline std::string to_string(const Action& a) {
  std::string s = std::to_string(a.stage) + type_token(a.type);
  if (has_microbatch(a.type)) s += std::to_string(a.microbatch);
  return s;
}

namespace detail {

inline std::string where(int line, int column) {
  return line > 0 ? "line " + std::to_string(line) + ", column " + std::to_string(column) + ": "
                  : std::string();
}

}  // namespace detail

// Parses one action; `line` and `column` (1-based, 0 when unknown) only label errors.
inline Action parse_action(const std::string& text, int line = 0, int column = 0) {
  auto fail = [&](const std::string& why) {
    throw ScheduleError(detail::where(line, column) + "'" + text + "' is not an action: " + why);
  };
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0) fail("it must start with a stage number");
  if (i > 6) fail("stage number too large");
  Action a;
  a.stage = std::stoi(text.substr(0, i));
  size_t j = i;
  while (j < text.size() && !std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
  const std::string token = text.substr(i, j - i);
  static const ActionType kTypes[] = {
      ActionType::kSendF,     ActionType::kRecvF,    ActionType::kSendB,         ActionType::kRecvB,
      ActionType::kUnshard,   ActionType::kReshard,  ActionType::kReduceGrad,    ActionType::kWaitReduceGrad,
      ActionType::kForward,   ActionType::kBackward, ActionType::kBackwardInput, ActionType::kBackwardWeight,
      ActionType::kWaitSendF, ActionType::kWaitSendB};
  if (token == "OVERLAP_F_B")
    fail("OVERLAP_F_B is a group of computations: write it (action;action)OVERLAP_F_B");
  bool found = false;
  for (auto t : kTypes)
    if (token == type_token(t)) {
      a.type = t;
      found = true;
    }
  if (!found)
    fail(
        "unknown type '" + token +
        "' (expected F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, WAIT_SEND_F, WAIT_SEND_B, UNSHARD, RESHARD, "
        "REDUCE_GRAD or WAIT_REDUCE_GRAD)");
  const std::string mb = text.substr(j);
  if (has_microbatch(a.type)) {
    if (mb.empty()) fail("a microbatch number must follow " + token);
    if (mb.size() > 6 || mb.find_first_not_of("0123456789") != std::string::npos)
      fail("bad microbatch number '" + mb + "'");
    a.microbatch = std::stoi(mb);
  } else if (!mb.empty()) {
    fail(token + " takes no microbatch");
  }
  return a;
}

// The end (one past the last action) of the group that starts at `i`: i + 1 for a lone action.
inline size_t group_end(const std::vector<Action>& actions, size_t i) {
  size_t j = i + 1;
  while (j < actions.size() && actions[j].with_previous) ++j;
  return j;
}

// Parses one cell of a table: an action, or an overlap group written as PyTorch's runtime writes it,
// "(0F1;3B0)OVERLAP_F_B" (Note [overlap groups]). `line` and `column` locate the cell; a group's
// errors name the inner column.
inline std::vector<Action> parse_cell(const std::string& text, int line = 0, int column = 0) {
  if (text.empty() || text.front() != '(') return {parse_action(text, line, column)};
  const size_t close = text.find(')');
  const std::string kind = close == std::string::npos ? "" : text.substr(close + 1);
  if (kind != "OVERLAP_F_B")
    throw ScheduleError(detail::where(line, column) + "'" + text +
                        "' is not an action: a group must read (action;action...)OVERLAP_F_B");
  std::vector<Action> out;
  size_t start = 1;
  while (start <= close) {
    size_t end = text.find(';', start);
    if (end == std::string::npos || end > close) end = close;
    std::string inner = text.substr(start, end - start);
    const size_t lead = std::min(inner.find_first_not_of(" \t"), inner.size());
    inner = inner.substr(lead, inner.find_last_not_of(" \t") + 1 - lead);
    const int inner_column = column > 0 ? column + static_cast<int>(start + lead) : 0;
    const Action a = parse_action(inner, line, inner_column);
    if (!is_compute(a.type))
      throw ScheduleError(detail::where(line, inner_column) + "'" + inner + "' in " + text +
                          ": a group holds compute actions only (F, B, I, W)");
    out.push_back(a);
    out.back().with_previous = out.size() > 1;
    start = end + 1;
  }
  if (out.size() < 2)
    throw ScheduleError(detail::where(line, column) + "'" + text + "': a group holds at least two actions");
  return out;
}

// CSV: one row per rank. Cells are trimmed; empty cells (idle slots) are skipped.
// Where each action of a table came from ("line 2, column 6"), for errors found after parsing.
using Positions = std::vector<std::vector<std::string>>;

inline Program parse_csv(std::istream& in, Positions* where = nullptr) {
  Program program;
  std::string row;
  int line = 0;
  while (std::getline(in, row)) {
    ++line;
    if (!row.empty() && row.back() == '\r') row.pop_back();
    std::vector<Action> actions;
    std::vector<std::string> at;
    size_t start = 0;
    while (start <= row.size()) {
      size_t end = row.find(',', start);
      if (end == std::string::npos) end = row.size();
      std::string cell = row.substr(start, end - start);
      const size_t b = cell.find_first_not_of(" \t"), e = cell.find_last_not_of(" \t");
      if (b != std::string::npos) {
        const int column = static_cast<int>(start + b + 1);
        for (const auto& a : parse_cell(cell.substr(b, e - b + 1), line, column)) {
          actions.push_back(a);
          at.push_back("line " + std::to_string(line) + ", column " + std::to_string(column));
        }
      }
      start = end + 1;
    }
    program.push_back(std::move(actions));
    if (where) where->push_back(std::move(at));
  }
  while (!program.empty() && program.back().empty()) {  // trailing blank lines
    program.pop_back();
    if (where) where->pop_back();
  }
  if (program.empty()) throw ScheduleError("the schedule CSV has no rows");
  return program;
}

// One cell per action, a group in one cell as PyTorch writes it.
inline std::vector<std::string> cells(const std::vector<Action>& actions) {
  std::vector<std::string> out;
  for (size_t i = 0; i < actions.size();) {
    const size_t end = group_end(actions, i);
    std::string cell = to_string(actions[i]);
    if (end > i + 1) {
      cell = "(" + cell;
      for (size_t j = i + 1; j < end; ++j) cell += ";" + to_string(actions[j]);
      cell += ")OVERLAP_F_B";
    }
    out.push_back(std::move(cell));
    i = end;
  }
  return out;
}

inline void write_csv(std::ostream& out, const Program& program) {
  for (const auto& rank : program) {
    const auto row = cells(rank);
    for (size_t i = 0; i < row.size(); ++i) out << (i ? "," : "") << row[i];
    out << "\n";
  }
}

}  // namespace fsdpp::pipeline
