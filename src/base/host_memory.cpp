#include "fsdpp/base/host_memory.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace fsdpp {
namespace {

// Each setting kept: its tunable, the older variable that also sets it (and where
// MallocEnvironment holds that variable's value), and its name in the log.
struct Setting {
  std::string_view tunable, variable, what;
  const char* MallocEnvironment::*value;
};
constexpr Setting kSettings[] = {
    {"glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_", "mmap threshold", &MallocEnvironment::mmap_threshold},
    {"glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_", "trim threshold", &MallocEnvironment::trim_threshold},
    {"glibc.malloc.top_pad", "MALLOC_TOP_PAD_", "top pad", &MallocEnvironment::top_pad}};

// GLIBC_TUNABLES is a colon-separated list of name=value.
std::vector<std::pair<std::string_view, std::string_view>> tunables(const char* value) {
  std::vector<std::pair<std::string_view, std::string_view>> out;
  std::string_view s = value ? value : "";
  while (!s.empty()) {
    const auto end = s.find(':');
    const auto item = s.substr(0, end);
    const auto eq = item.find('=');
    if (eq != std::string_view::npos) out.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    if (end == std::string_view::npos) break;
    s.remove_prefix(end + 1);
  }
  return out;
}

std::string bytes(std::string_view value) {
  uint64_t n = 0;
  for (const char c : value) {
    if (c < '0' || c > '9') return std::string(value);  // glibc also takes hexadecimal; show it as given
    n = n * 10 + uint64_t(c - '0');
  }
  if (n >= (uint64_t(1) << 30) && n % (uint64_t(1) << 30) == 0) return fmt::format("{} GiB", n >> 30);
  if (n >= (uint64_t(1) << 20) && n % (uint64_t(1) << 20) == 0) return fmt::format("{} MiB", n >> 20);
  return fmt::format("{} bytes", n);
}

bool set(const char* v) { return v && *v; }

// Each setting `env` makes: what it is ("mmap threshold", ...), its value as written, and where.
struct Found {
  std::string_view what, value, source;
};
std::vector<Found> settings(const MallocEnvironment& env) {
  std::vector<Found> out;
  for (const auto& [name, value] : tunables(env.tunables))
    for (const auto& s : kSettings)
      if (name == s.tunable) out.push_back({s.what, value, "GLIBC_TUNABLES"});
  for (const auto& s : kSettings)
    if (set(env.*s.value)) out.push_back({s.what, env.*s.value, s.variable});
  return out;
}

}  // namespace

MallocEnvironment malloc_environment() {
  MallocEnvironment env{std::getenv("GLIBC_TUNABLES")};
  for (const auto& s : kSettings) env.*s.value = std::getenv(std::string(s.variable).c_str());
  return env;
}

std::optional<std::string> with_kept_malloc_thresholds(const MallocEnvironment& env) {
  if (!settings(env).empty()) return std::nullopt;
  if (!set(env.tunables)) return std::string(kKeptMallocTunables);
  return fmt::format("{}:{}", env.tunables, kKeptMallocTunables);
}

std::string describe_malloc_thresholds(const MallocEnvironment& env) {
  const auto found = settings(env);
  if (found.empty()) return "malloc's own thresholds";
  std::vector<std::string> parts;
  std::vector<std::string_view> sources;
  for (const auto& t : found) {
    parts.push_back(fmt::format("{} {}", t.what, bytes(t.value)));
    if (sources.empty() || sources.back() != t.source) sources.push_back(t.source);
  }
  return fmt::format("{} ({})", fmt::join(parts, ", "), fmt::join(sources, ", "));
}

}  // namespace fsdpp
