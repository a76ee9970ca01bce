#pragma once
// The lexing of chat_template.hpp's Jinja subset: a template cut into text and tags with Jinja's
// whitespace rules as transformers configures them (trim_blocks, lstrip_blocks, "-" and "+"
// markers, the one trailing newline dropped), and a tag's expression cut into tokens.
#include <string>
#include <vector>

namespace fsdpp::train::text::jinja {

// A parse error at a template line (std::invalid_argument "line N: ...").
[[noreturn]] void parse_fail(int line, const std::string& what);

struct Segment {
  enum class Kind { text, output, block, comment } kind;
  std::string text;
  int line;
  bool strip_before = false, strip_after = false, keep_before = false;
};

// The source cut into text and tags, the whitespace rules applied to the text.
std::vector<Segment> segments_of(std::string src);

struct Token {
  enum class Kind { name, string, integer, number, op, end } kind;
  std::string text;
};

std::vector<Token> tokens_of(const std::string& s, int line);

}  // namespace fsdpp::train::text::jinja
