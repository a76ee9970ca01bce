#include "regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <stdexcept>
#include <string>

#include "unicode.hpp"

namespace fsdpp::train::text {

struct Regex::Compiled {
  pcre2_code* code = nullptr;
  ~Compiled() { pcre2_code_free(code); }
};

Regex::Regex(std::string_view pattern, bool literal) : compiled_(std::make_unique<Compiled>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  uint32_t options = PCRE2_UTF | PCRE2_UCP;
  if (literal) options = PCRE2_UTF | PCRE2_LITERAL;  // PCRE2 takes no UCP with LITERAL (and needs none)
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                  &error, &offset, nullptr);
  if (!compiled_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw std::invalid_argument(fmt::format("regular expression \"{}\": {} at offset {}", pattern,
                                            reinterpret_cast<const char*>(message), offset));
  }
  pcre2_jit_compile(compiled_->code,
                    PCRE2_JIT_COMPLETE);  // falls back to the interpreter where JIT is absent
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view subject) const {
  struct MatchData {
    pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
    ~MatchData() { pcre2_match_data_free(data); }
  };
  thread_local MatchData match;
  std::vector<std::pair<size_t, size_t>> out;
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t from = 0, previous_end = std::string_view::npos;
  while (from <= subject.size()) {
    const int rc =
        pcre2_match(compiled_->code, s, subject.size(), from, PCRE2_NO_UTF_CHECK, match.data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw std::runtime_error(
          fmt::format("regular expression match: {}", reinterpret_cast<const char*>(message)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (begin == end) {
      if (begin != previous_end) out.emplace_back(begin, end);
      if (end >= subject.size()) break;
      from = end + char_bytes(static_cast<unsigned char>(subject[end]));
    } else {
      out.emplace_back(begin, end);
      from = end;
    }
    previous_end = end;
  }
  return out;
}

}  // namespace fsdpp::train::text
