#pragma once
// Action tables from files: CSV (one rank per row) or JSON ({"ranks": [["0F0", "0F1", ...], ...]}).

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "pipeline/action.hpp"
#include "pipeline/schedule.hpp"

namespace fsdpp::pipeline {

inline Program parse_json_table(std::istream& in, Positions* where = nullptr) {
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
    if (where) where->emplace_back();
    for (size_t i = 0; i < row.size(); ++i) {
      if (row[i].is_null()) continue;  // an idle slot
      if (!row[i].is_string())
        throw ScheduleError("/ranks/" + std::to_string(r) + "/" + std::to_string(i) + " is not a string");
      try {
        for (const auto& a : parse_cell(row[i].get<std::string>())) {
          program.back().push_back(a);
          if (where) where->back().push_back("/ranks/" + std::to_string(r) + "/" + std::to_string(i));
        }
      } catch (const ScheduleError& e) {
        throw ScheduleError("/ranks/" + std::to_string(r) + "/" + std::to_string(i) + ": " + e.what());
      }
    }
  }
  if (program.empty()) throw ScheduleError("the action table has no ranks");
  return program;
}

// Reads `path` as JSON when it ends in .json, as CSV otherwise; errors name the file.
inline Program load_table(const std::string& path, Positions* where = nullptr) {
  std::ifstream f(path);
  if (!f) throw ScheduleError("cannot read " + path);
  const bool json = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  try {
    return json ? parse_json_table(f, where) : parse_csv(f, where);
  } catch (const ScheduleError& e) {
    throw ScheduleError(path + ": " + e.what());
  }
}

// A schedule from a table file, named by its path; stages or microbatches out of range are
// reported with the line and column (or JSON path) of the action.
inline std::unique_ptr<TableSchedule> load_table_schedule(const std::string& path) {
  Positions where;
  auto program = load_table(path, &where);
  return std::make_unique<TableSchedule>(path, std::move(program), std::move(where));
}

// Whether a schedule name is an action table file (.csv or .json) rather than a registered name.
inline bool is_table_file(const std::string& s) {
  auto ends = [&](const char* suffix) {
    const std::string x(suffix);
    return s.size() > x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  return ends(".csv") || ends(".json");
}

// A registered schedule, or one read from an action table file.
inline std::unique_ptr<Schedule> schedule_from(const std::string& name_or_path) {
  return is_table_file(name_or_path) ? load_table_schedule(name_or_path) : make_schedule(name_or_path);
}

}  // namespace fsdpp::pipeline
