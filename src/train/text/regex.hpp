#pragma once
// Unicode regular expressions for tokenizer.json's patterns, on PCRE2 (JIT-compiled, UTF mode with
// Unicode properties for \w, \s, \d and case folding). Why PCRE2: docs/building.md.
#include <cstddef>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

namespace fsdpp::train::text {

class Regex {
 public:
  // `literal`: the pattern is a plain string. Throws std::invalid_argument with PCRE2's message and
  // the offset it points at.
  explicit Regex(std::string_view pattern, bool literal = false);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // The non-overlapping matches in `subject` (valid UTF-8), in order, as [begin, end) byte offsets.
  // An empty match right after the previous match is skipped, and the search moves on by a character
  // after an empty match, as Oniguruma's iterator does (tokenizers' regex engine).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view subject) const;

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace fsdpp::train::text
