#include "fsdpp/base/host_memory.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace fsdpp {
namespace {

constexpr std::string_view kMmap = "glibc.malloc.mmap_threshold", kTrim = "glibc.malloc.trim_threshold";

// GLIBC_TUNABLES is a colon-separated list of name=value.
std::vector<std::pair<std::string_view, std::string_view>> tunables(std::string_view s) {
  std::vector<std::pair<std::string_view, std::string_view>> out;
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

}  // namespace

std::optional<std::string> with_kept_malloc_thresholds(const char* current) {
  const std::string_view now = current ? current : "";
  for (const auto& [name, value] : tunables(now))
    if (name == kMmap || name == kTrim) return std::nullopt;
  if (now.empty()) return std::string(kKeptMallocTunables);
  return fmt::format("{}:{}", now, kKeptMallocTunables);
}

std::string describe_malloc_thresholds(const char* current) {
  std::string out;
  for (const auto& [name, value] : tunables(current ? current : "")) {
    if (name != kMmap && name != kTrim) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} threshold {}", name == kMmap ? "mmap" : "trim", bytes(value));
  }
  return out.empty() ? "malloc's own thresholds" : out + " (GLIBC_TUNABLES)";
}

}  // namespace fsdpp
