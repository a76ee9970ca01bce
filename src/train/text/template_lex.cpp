#include "template_lex.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <stdexcept>

namespace fsdpp::train::text::jinja {

[[noreturn]] void parse_fail(int line, const std::string& what) {
  throw std::invalid_argument(fmt::format("line {}: {}", line, what));
}

// The source cut into text and tags, with Jinja's whitespace rules applied to the text.
std::vector<Segment> segments_of(std::string src) {
  if (!src.empty() && src.back() == '\n') src.pop_back();
  std::vector<Segment> out;
  size_t at = 0;
  int line = 1;
  const auto count_lines = [](std::string_view s) {
    return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
  };
  while (at < src.size()) {
    const size_t open = src.find('{', at);
    size_t tag = std::string::npos;
    for (size_t p = open; p != std::string::npos && p + 1 < src.size(); p = src.find('{', p + 1))
      if (src[p + 1] == '{' || src[p + 1] == '%' || src[p + 1] == '#') {
        tag = p;
        break;
      }
    if (tag == std::string::npos) {
      out.push_back({Segment::Kind::text, src.substr(at), line});
      break;
    }
    if (tag > at) {
      out.push_back({Segment::Kind::text, src.substr(at, tag - at), line});
      line += count_lines(out.back().text);
    }
    const char kind = src[tag + 1];
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const size_t end = src.find(close, tag + 2);
    if (end == std::string::npos)
      parse_fail(line, fmt::format("\"{}\" is never closed by \"{}\"", src.substr(tag, 2), close));
    Segment s{kind == '{'   ? Segment::Kind::output
              : kind == '%' ? Segment::Kind::block
                            : Segment::Kind::comment,
              src.substr(tag + 2, end - tag - 2), line};
    if (!s.text.empty() && (s.text.front() == '-' || s.text.front() == '+')) {
      (s.text.front() == '-' ? s.strip_before : s.keep_before) = true;
      s.text.erase(0, 1);
    }
    if (!s.text.empty() && s.text.back() == '-') {
      s.strip_after = true;
      s.text.pop_back();
    }
    line += count_lines(s.text);
    out.push_back(std::move(s));
    at = end + 2;
  }
  const auto is_space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  for (size_t k = 0; k < out.size(); ++k) {
    auto& s = out[k];
    if (s.kind == Segment::Kind::text) continue;
    Segment* before = k > 0 && out[k - 1].kind == Segment::Kind::text ? &out[k - 1] : nullptr;
    Segment* after = k + 1 < out.size() && out[k + 1].kind == Segment::Kind::text ? &out[k + 1] : nullptr;
    const bool statement = s.kind != Segment::Kind::output;
    if (before && s.strip_before) {
      while (!before->text.empty() && is_space(before->text.back())) before->text.pop_back();
    } else if (before && statement && !s.keep_before) {
      // lstrip_blocks: spaces and tabs between a line's start and a statement go.
      const size_t nl = before->text.find_last_of('\n');
      const size_t from = nl == std::string::npos ? 0 : nl + 1;
      const bool line_start = nl != std::string::npos || k == 1;
      if (line_start && before->text.find_first_not_of(" \t", from) == std::string::npos)
        before->text.erase(from);
    }
    if (after && s.strip_after) {
      size_t n = 0;
      while (n < after->text.size() && is_space(after->text[n])) ++n;
      after->text.erase(0, n);
    } else if (after && statement) {
      // trim_blocks: the newline right after a statement goes.
      if (after->text.starts_with("\r\n"))
        after->text.erase(0, 2);
      else if (after->text.starts_with("\n"))
        after->text.erase(0, 1);
    }
  }
  return out;
}

std::vector<Token> tokens_of(const std::string& s, int line) {
  std::vector<Token> out;
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Token::Kind::name, s.substr(i, j - i)});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool real = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_' ||
                              (s[j] == '.' && !real && j + 1 < s.size() &&
                               std::isdigit(static_cast<unsigned char>(s[j + 1])))))
        real |= s[j++] == '.';
      std::string digits = s.substr(i, j - i);
      std::erase(digits, '_');
      out.push_back({real ? Token::Kind::number : Token::Kind::integer, digits});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string text;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          text.push_back(s[j]);
          continue;
        }
        const char e = s[++j];
        switch (e) {
          case 'n':
            text.push_back('\n');
            break;
          case 't':
            text.push_back('\t');
            break;
          case 'r':
            text.push_back('\r');
            break;
          case '\\':
          case '\'':
          case '"':
            text.push_back(e);
            break;
          default:
            text.push_back('\\'), text.push_back(e);
        }
      }
      if (j >= s.size()) parse_fail(line, "a string is never closed");
      out.push_back({Token::Kind::string, std::move(text)});
      i = j + 1;
    } else {
      static const char* two[] = {"==", "!=", "<=", ">=", "//", "**"};
      std::string op(1, c);
      for (const char* t : two)
        if (s.compare(i, 2, t) == 0) op = t;
      if (std::string("+-*/%~<>=!|.,:()[]{}").find(c) == std::string::npos)
        parse_fail(line, fmt::format("unexpected character '{}'", c));
      out.push_back({Token::Kind::op, op});
      i += op.size();
    }
  }
  out.push_back({Token::Kind::end, ""});
  return out;
}

}  // namespace fsdpp::train::text::jinja
