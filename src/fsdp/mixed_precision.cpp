#include "fsdpp/fsdp/mixed_precision.hpp"

#include <ATen/core/Tensor.h>

namespace fsdpp::fsdp {

bool glob_match(const std::string& pattern, const std::string& text) {
  // Iterative '*' matching with backtracking to the last star.
  size_t p = 0, t = 0, star = std::string::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

DtypeFn dtype_for(std::vector<std::string> patterns, at::ScalarType dtype) {
  return [patterns = std::move(patterns), dtype](const std::string& name,
                                                 const at::Tensor&) -> std::optional<at::ScalarType> {
    for (const auto& p : patterns)
      if (glob_match(p, name)) return dtype;
    return std::nullopt;
  };
}

}  // namespace fsdpp::fsdp
