#pragma once
// What the schedule tests share: actions as text, and the error a call throws.
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "fsdpp/pipeline/action.hpp"

namespace schedule_test {

using namespace fsdpp::pipeline;

inline std::string joined(const std::vector<Action>& actions) {
  std::string s;
  for (const auto& a : actions) s += (s.empty() ? "" : " ") + to_string(a);
  return s;
}

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "no error";
}

inline Program from_csv(const std::string& text) {
  std::istringstream in(text);
  return parse_csv(in);
}

}  // namespace schedule_test
