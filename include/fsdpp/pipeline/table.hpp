#pragma once
// Action tables from files: CSV (one rank per row) or JSON ({"ranks": [["0F0", "0F1", ...], ...]}).

#include <fstream>
#include <optional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "fsdpp/base/paths.hpp"
#include "fsdpp/pipeline/action.hpp"
#include "fsdpp/pipeline/fsdp_actions.hpp"
#include "fsdpp/pipeline/schedule.hpp"

namespace fsdpp::pipeline {

// A schedule read from a CSV action table (one row per rank). The layout is taken from where
// each stage appears; the spec must match the table.
class TableSchedule : public Schedule {
 public:
  // `where` (optional) gives each action's place in the file, for errors.
  TableSchedule(std::string name, Program program, Positions where = {})
      : name_(std::move(name)), program_(std::move(program)), where_(std::move(where)) {}
  std::string name() const override { return name_; }
  bool places_stages_by_layout() const override { return false; }
  void check(const ScheduleSpec& s) const override {
    Schedule::check(s);
    for (size_t r = 0; r < program_.size(); ++r)
      for (size_t i = 0; i < program_[r].size(); ++i) {
        const Action& a = program_[r][i];
        const std::string at = place(r, i);
        if (a.stage >= s.num_stages())
          throw ScheduleError(name_ + ": " + at + ": '" + to_string(a) + "' names stage " +
                              std::to_string(a.stage) + ", but there are " + std::to_string(s.num_stages()) +
                              " stages");
        if (has_microbatch(a.type) && a.microbatch >= s.microbatches)
          throw ScheduleError(name_ + ": " + at + ": '" + to_string(a) + "' names microbatch " +
                              std::to_string(a.microbatch) + ", but there are " +
                              std::to_string(s.microbatches));
      }
  }
  // Without its SEND/RECV, WAIT_SEND and FSDP actions, if it has any.
  Program compute_actions(const ScheduleSpec& s) const override {
    if (static_cast<int>(program_.size()) != s.pp)
      throw ScheduleError(name_ + ": the table has " + std::to_string(program_.size()) + " rows but pp is " +
                          std::to_string(s.pp));
    Program compute(program_.size());
    for (size_t r = 0; r < program_.size(); ++r)
      for (const auto& a : program_[r])
        if (!is_send_recv(a.type) && !is_send_wait(a.type) && !is_fsdp_action(a.type))
          compute[r].push_back(a);
    return compute;
  }
  // A table with SEND/RECV actions is taken as lowered: they must be the ones its computations need,
  // and come in the same order on both ranks of each pair (Note [point-to-point order]); its
  // WAIT_SEND actions, if it has any, one after each send (without any, the plan adds them as for a
  // compute-only table); its FSDP actions, if it has any, placed as the plan places them (a table
  // that `fsdpp schedule show --fsdp --out X` wrote loads back as it was written). Errors name the
  // table and the action's place in it.
  std::optional<Program> lowered_actions(const ScheduleSpec& s) const override {
    bool lowered = false;
    for (const auto& rank : program_)
      for (const auto& a : rank) lowered = lowered || is_send_recv(a.type) || is_send_wait(a.type);
    if (!lowered) {
      for (size_t r = 0; r < program_.size(); ++r)
        for (size_t i = 0; i < program_[r].size(); ++i)
          if (is_fsdp_action(program_[r][i].type))
            throw ScheduleError(name_ + ": " + place(r, i) + ": '" + to_string(program_[r][i]) +
                                "' belongs in a lowered table, with the SEND and RECV actions its stages "
                                "need; a compute table holds only F, B, I and W actions");
      return std::nullopt;
    }
    if (static_cast<int>(program_.size()) != s.pp)
      throw ScheduleError(name_ + ": the table has " + std::to_string(program_.size()) + " rows but pp is " +
                          std::to_string(s.pp));
    try {
      const auto owner = infer_stage_ranks(program_, s.num_stages());
      validate_send_recv(program_, owner, &where_);
      check_point_to_point_order(program_, owner, &where_);
      if (has_send_waits(program_)) validate_send_waits(program_, &where_);
      if (has_fsdp_actions(program_)) validate_fsdp_actions(program_, &where_);
    } catch (const ScheduleError& e) {
      throw ScheduleError(name_ + ": " + e.what());
    }
    return program_;
  }

 private:
  // Where action i of rank r is in the file ("line 2, column 5"), or its index.
  std::string place(size_t r, size_t i) const {
    return r < where_.size() && i < where_[r].size()
               ? where_[r][i]
               : "rank " + std::to_string(r) + ", action " + std::to_string(i);
  }
  std::string name_;
  Program program_;
  Positions where_;
};

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
  try {
    require_regular_file(path, "schedule table");
  } catch (const std::runtime_error& e) {
    throw ScheduleError(e.what());
  }
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
