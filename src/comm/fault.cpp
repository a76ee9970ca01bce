#include "fsdpp/comm/fault.hpp"

#include "fsdpp/comm/flight_recorder.hpp"

#include <fmt/format.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace fsdpp::comm {

namespace {

// A whole non-negative decimal number, or -1.
int64_t whole_number(const std::string& s) {
  if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(s);
}

Fault parse(const char* text, int world_size) {
  Fault f;
  if (!text || !*text) return f;
  std::istringstream in(text);
  std::string part;
  std::getline(in, f.kind, ':');
  std::string at_key;
  bool bad_value = false;
  while (std::getline(in, part, ':')) {
    const auto eq = part.find('=');
    const std::string key = part.substr(0, eq), value = eq == std::string::npos ? "" : part.substr(eq + 1);
    const int64_t n = whole_number(value);
    if (key == "rank")
      f.rank = n > INT32_MAX ? -1 : static_cast<int>(n);
    else if (key == "attempt")
      f.attempt = value == "any" ? -1 : n > INT32_MAX ? -2 : static_cast<int>(n);
    else
      f.at = n, at_key = key;
    bad_value |= n < 0 && !(key == "attempt" && value == "any");
  }
  if (world_size > 0 && f.rank >= world_size)
    throw std::invalid_argument(
        fmt::format("FSDPP_FAULT={}: rank {} is outside the world of {} ranks (0 to {})", text, f.rank,
                    world_size, world_size - 1));
  // This process's start of the group (TORCHELASTIC_RESTART_COUNT, 0 on the first).
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int attempt_now = restart ? std::atoi(restart) : 0;
  if (f.attempt >= 0 && f.attempt != attempt_now) f.disarmed = true;
  const bool ok = !bad_value && f.rank >= 0 && f.at >= 0 &&
                  ((f.kind == "skip_all_gather" && at_key == "count") ||
                   ((f.kind == "kill" || f.kind == "kill_in_checkpoint") && at_key == "step"));
  if (!ok)
    throw std::invalid_argument(
        fmt::format("FSDPP_FAULT={}: expected skip_all_gather:rank=R:count=N, kill:rank=R:step=N or "
                    "kill_in_checkpoint:rank=R:step=N "
                    "(R and N whole numbers), optionally followed by :attempt=K or :attempt=any",
                    text));
  return f;
}

}  // namespace

namespace {

std::atomic<const Fault*> g_armed{nullptr};  // set once by arm_faults_from_env

}  // namespace

const Fault& arm_faults_from_env() {
  static const Fault f = [] {
    const char* world = std::getenv("WORLD_SIZE");
    return parse(std::getenv("FSDPP_FAULT"), world ? static_cast<int>(whole_number(world)) : 0);
  }();
  g_armed.store(&f);
  return f;
}

const Fault& injected_fault() {
  static const Fault none;
  const Fault* f = g_armed.load(std::memory_order_acquire);
  return f ? *f : none;
}

void check_injected_fault(int world_size, int64_t last_step) {
  const char* text = std::getenv("FSDPP_FAULT");
  const Fault f = parse(text, world_size);
  if (last_step >= 0 && (f.kind == "kill" || f.kind == "kill_in_checkpoint") && f.at > last_step)
    throw std::invalid_argument(
        fmt::format("FSDPP_FAULT={}: step {} is past the run's last step ({}): the fault "
                    "would never fire",
                    text, f.at, last_step));
}

namespace detail {

bool skip_this_all_gather() {
  // Called by every all_gather: without an armed fault, one atomic load.
  const Fault* armed = g_armed.load(std::memory_order_acquire);
  if (!armed || armed->kind != "skip_all_gather" || armed->disarmed) return false;
  const Fault& f = *armed;
  static const int rank = [] {
    const char* r = std::getenv("RANK");
    return r ? std::atoi(r) : 0;
  }();
  // Only labelled operations count (fully_shard's unshards, not set-up checks), so that N picks
  // an operation of training whatever the set-up issued.
  if (rank != f.rank || OpLabel::current().empty()) return false;
  static std::atomic<int64_t> count{0};
  return ++count == f.at;
}

}  // namespace detail

}  // namespace fsdpp::comm
