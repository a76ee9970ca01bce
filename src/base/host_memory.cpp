#include "fsdpp/base/host_memory.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace fsdpp {
namespace {

constexpr std::string_view kMmap = "glibc.malloc.mmap_threshold", kTrim = "glibc.malloc.trim_threshold";

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

// Each threshold `env` sets: which ("mmap" or "trim"), its value as written, and the variable.
struct Threshold {
  std::string_view what, value, source;
};
std::vector<Threshold> thresholds(const MallocEnvironment& env) {
  std::vector<Threshold> out;
  for (const auto& [name, value] : tunables(env.tunables))
    if (name == kMmap || name == kTrim) out.push_back({name == kMmap ? "mmap" : "trim", value, "GLIBC_TUNABLES"});
  if (set(env.mmap_threshold)) out.push_back({"mmap", env.mmap_threshold, "MALLOC_MMAP_THRESHOLD_"});
  if (set(env.trim_threshold)) out.push_back({"trim", env.trim_threshold, "MALLOC_TRIM_THRESHOLD_"});
  return out;
}

}  // namespace

MallocEnvironment malloc_environment() {
  return {std::getenv("GLIBC_TUNABLES"), std::getenv("MALLOC_MMAP_THRESHOLD_"), std::getenv("MALLOC_TRIM_THRESHOLD_")};
}

std::optional<std::string> with_kept_malloc_thresholds(const MallocEnvironment& env) {
  if (!thresholds(env).empty()) return std::nullopt;
  if (!set(env.tunables)) return std::string(kKeptMallocTunables);
  return fmt::format("{}:{}", env.tunables, kKeptMallocTunables);
}

std::string describe_malloc_thresholds(const MallocEnvironment& env) {
  const auto found = thresholds(env);
  if (found.empty()) return "malloc's own thresholds";
  std::vector<std::string> parts;
  std::vector<std::string_view> sources;
  for (const auto& t : found) {
    parts.push_back(fmt::format("{} threshold {}", t.what, bytes(t.value)));
    if (sources.empty() || sources.back() != t.source) sources.push_back(t.source);
  }
  return fmt::format("{} ({})", fmt::join(parts, ", "), fmt::join(sources, ", "));
}

}  // namespace fsdpp
