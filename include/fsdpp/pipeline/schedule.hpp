#pragma once
// Schedules: given the pipeline size, stages per rank and microbatch count, each rank's ordered
// compute actions (F, B, I, W). Built-ins and user schedules share one registry, so a schedule
// written in C++ or loaded from a CSV action table runs through the same lowering, validator,
// simulator and executor.
//
// A Schedule must provide:
//   name()                       the registry name
//   layout()                     which stages a rank holds (loop: r, r+p, ...; V: r and 2p-1-r)
//   check(spec)                  throw ScheduleError when the spec is outside what it supports
//   compute_actions(spec)        one list of compute actions per rank
// and may provide:
//   lowered_actions(spec)        the same with its own SEND/RECV actions (a lowered table): make_plan
//                                then keeps them where they are, after checking them, instead of
//                                placing its own
// This file holds the interface and the registry; the built-ins are in builtin_schedules.hpp
// (included below), tables (TableSchedule) in table.hpp.

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fsdpp/pipeline/action.hpp"
#include "fsdpp/pipeline/lowering.hpp"

namespace fsdpp::pipeline {

struct ScheduleSpec {
  int pp = 2;               // pipeline ranks
  int stages_per_rank = 1;  // v
  int microbatches = 4;     // m
  int num_stages() const { return pp * stages_per_rank; }
};

enum class Layout { kLoop, kV };

// The rank that holds `stage`.
inline int stage_rank(Layout layout, int stage, int pp) {
  if (layout == Layout::kV) return stage < pp ? stage : 2 * pp - 1 - stage;
  return stage % pp;
}

class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  virtual Layout layout() const { return Layout::kLoop; }
  virtual void check(const ScheduleSpec& spec) const {
    if (spec.pp < 1 || spec.stages_per_rank < 1 || spec.microbatches < 1)
      throw ScheduleError(name() + ": pp, stages per rank and microbatches must be positive");
  }
  virtual Program compute_actions(const ScheduleSpec& spec) const = 0;
  virtual std::optional<Program> lowered_actions(const ScheduleSpec&) const { return std::nullopt; }
  // Whether each stage sits where layout() puts it (make_plan checks it); a table places its stages
  // where they appear instead.
  virtual bool places_stages_by_layout() const { return true; }
};

using ScheduleFactory = std::function<std::unique_ptr<Schedule>()>;

namespace detail {

inline std::map<std::string, ScheduleFactory>& registry() {
  static std::map<std::string, ScheduleFactory> r;
  return r;
}
inline std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace detail

// Registers (or replaces) a schedule under `name`.
inline void register_schedule(const std::string& name, ScheduleFactory factory) {
  std::lock_guard<std::mutex> lock(detail::registry_mutex());
  detail::registry()[name] = std::move(factory);
}

inline void register_builtin_schedules();  // builtin_schedules.hpp

inline std::vector<std::string> schedule_names() {
  register_builtin_schedules();
  std::lock_guard<std::mutex> lock(detail::registry_mutex());
  std::vector<std::string> out;
  for (const auto& [k, v] : detail::registry()) out.push_back(k);
  return out;
}

inline std::unique_ptr<Schedule> make_schedule(const std::string& name) {
  register_builtin_schedules();
  std::unique_lock<std::mutex> lock(detail::registry_mutex());
  auto it = detail::registry().find(name);
  if (it == detail::registry().end()) {
    std::string known;
    for (const auto& [k, v] : detail::registry()) known += (known.empty() ? "" : ", ") + k;
    throw ScheduleError("unknown schedule '" + name + "' (known: " + known + ")");
  }
  auto factory = it->second;
  lock.unlock();
  return factory();
}

}  // namespace fsdpp::pipeline

#include "fsdpp/pipeline/builtin_schedules.hpp"
