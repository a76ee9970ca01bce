#pragma once
// Action tables from files: CSV (one rank per row) or JSON ({"ranks": [["0F0", "0F1", ...], ...]}).

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "pipeline/action.hpp"

namespace fsdpp::pipeline {

inline Program parse_json_table(std::istream& in) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ScheduleError(std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("ranks") || !j["ranks"].is_array())
    throw ScheduleError("a JSON action table is an object with \"ranks\": a list of lists of actions");
  Program program;
  for (size_t r = 0; r < j["ranks"].size(); ++r) {
    const auto& row = j["ranks"][r];
    if (!row.is_array()) throw ScheduleError("/ranks/" + std::to_string(r) + " is not a list");
    program.emplace_back();
    for (size_t i = 0; i < row.size(); ++i) {
      if (row[i].is_null()) continue;  // an idle slot
      if (!row[i].is_string())
        throw ScheduleError("/ranks/" + std::to_string(r) + "/" + std::to_string(i) + " is not a string");
      try {
        program.back().push_back(parse_action(row[i].get<std::string>()));
      } catch (const ScheduleError& e) {
        throw ScheduleError("/ranks/" + std::to_string(r) + "/" + std::to_string(i) + ": " + e.what());
      }
    }
  }
  if (program.empty()) throw ScheduleError("the action table has no ranks");
  return program;
}

// Reads `path` as JSON when it ends in .json, as CSV otherwise; errors name the file.
inline Program load_table(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw ScheduleError("cannot read " + path);
  const bool json = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  try {
    return json ? parse_json_table(f) : parse_csv(f);
  } catch (const ScheduleError& e) {
    throw ScheduleError(path + ": " + e.what());
  }
}

}  // namespace fsdpp::pipeline
