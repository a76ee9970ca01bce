#pragma once
// The FSDP actions of a lowered program that came whole (a table `fsdpp schedule show --fsdp
// --out X` wrote, or a schedule's own lowered_actions): checked as the plan's own passes place them,
// so that such a program runs as one the plan lowered itself.

#include <set>
#include <string>

#include "fsdpp/pipeline/action.hpp"

namespace fsdpp::pipeline {

inline bool is_fsdp_action(ActionType t) {
  return t == ActionType::kUnshard || t == ActionType::kReshard || t == ActionType::kReduceGrad ||
         t == ActionType::kWaitReduceGrad;
}

inline bool has_fsdp_actions(const Program& program) {
  for (const auto& rank : program)
    for (const auto& a : rank)
      if (is_fsdp_action(a.type)) return true;
  return false;
}

// On each rank: a stage computes only while gathered (an UNSHARD before, no RESHARD since), is
// gathered and resharded in turn, ends resharded, and gets exactly one REDUCE_GRAD, after its last
// backward. (WAIT_REDUCE_GRAD is validate_reduce_waits'.) Throws ScheduleError naming the rank and
// action, or the action's place in its file where `where` gives it.
inline void validate_fsdp_actions(const Program& program, const Positions* where = nullptr) {
  for (size_t r = 0; r < program.size(); ++r) {
    std::set<int> gathered, reduced, backward;
    const auto fail = [&](size_t i, const std::string& why) {
      const std::string at = where && r < where->size() && i < (*where)[r].size()
                                 ? (*where)[r][i]
                                 : "rank " + std::to_string(r) + ", action " + std::to_string(i);
      throw ScheduleError(at + ": '" + to_string(program[r][i]) + "' " + why);
    };
    for (size_t i = 0; i < program[r].size(); ++i) {
      const Action& a = program[r][i];
      using T = ActionType;
      if (a.type == T::kUnshard && !gathered.insert(a.stage).second)
        fail(i, "gathers a stage already gathered");
      if (a.type == T::kReshard && gathered.erase(a.stage) == 0)
        fail(i, "reshards a stage that is not gathered");
      if (is_compute(a.type) && !gathered.count(a.stage))
        fail(i, "computes on a resharded stage (an UNSHARD of its stage belongs before it)");
      if (is_compute(a.type) && a.type != T::kForward) {
        if (reduced.count(a.stage))
          fail(i, "comes after its stage's REDUCE_GRAD (which follows the last backward)");
        backward.insert(a.stage);
      }
      if (a.type == T::kReduceGrad && !reduced.insert(a.stage).second)
        fail(i, "reduces a stage a second time");
    }
    if (!gathered.empty())
      throw ScheduleError("rank " + std::to_string(r) + ": stage " + std::to_string(*gathered.begin()) +
                          " is still gathered at the end (add its RESHARD)");
    for (int s : backward)
      if (!reduced.count(s))
        throw ScheduleError("rank " + std::to_string(r) + ": stage " + std::to_string(s) +
                            " has no REDUCE_GRAD after its last backward");
  }
}

}  // namespace fsdpp::pipeline
