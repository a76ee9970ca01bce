#pragma once
// What hf_pipeline.cpp (normalizers, pre-tokenizers) and hf_decoders.cpp share: reading a
// tokenizer.json object's fields, its patterns, the Metaspace settings and the byte-level alphabet.
#include <fmt/format.h>

#include <array>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "regex.hpp"
#include "unicode.hpp"

namespace fsdpp::train::text::detail {

using nlohmann::json;

[[noreturn]] inline void refuse(const std::string& where, const std::string& what) {
  throw std::invalid_argument(fmt::format("{}: {}", where, what));
}

inline std::string type_of(const json& spec, const std::string& where) {
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string())
    refuse(where, "expected an object with a \"type\"");
  return spec["type"].get<std::string>();
}

template <class T>
T field(const json& spec, const char* key, const T& fallback, const std::string& where) {
  if (!spec.contains(key) || spec[key].is_null()) return fallback;
  try {
    return spec[key].get<T>();
  } catch (const json::exception&) {
    refuse(where + "." + key, fmt::format("unexpected value {}", spec[key].dump()));
  }
}

// {"String": "..."} or {"Regex": "..."}.
inline Regex pattern_of(const json& spec, const std::string& where) {
  const json& p = spec.contains("pattern") ? spec["pattern"] : json();
  try {
    if (p.is_object() && p.contains("String") && p["String"].is_string())
      return Regex(p["String"].get<std::string>(), /*literal=*/true);
    if (p.is_object() && p.contains("Regex") && p["Regex"].is_string())
      return Regex(p["Regex"].get<std::string>());
  } catch (const std::invalid_argument& e) {
    refuse(where + ".pattern", e.what());
  }
  refuse(where + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}");
}

inline std::string replace_all(const Regex& regex, const std::string& text, const std::string& content) {
  const auto matches = regex.find_all(text);
  if (matches.empty()) return text;
  std::string out;
  out.reserve(text.size() + matches.size() * content.size());
  size_t previous = 0;
  for (const auto& [begin, end] : matches) {
    out.append(text, previous, begin - previous);
    out.append(content);
    previous = end;
  }
  out.append(text, previous);
  return out;
}

enum class Prepend { always, first, never };

inline Prepend prepend_of(const json& spec, const std::string& where) {
  if (spec.contains("prepend_scheme") && !spec["prepend_scheme"].is_null()) {
    const auto s = field<std::string>(spec, "prepend_scheme", "", where);
    if (s == "always") return Prepend::always;
    if (s == "first") return Prepend::first;
    if (s == "never") return Prepend::never;
    refuse(where + ".prepend_scheme", fmt::format("\"{}\" is not one of always, first, never", s));
  }
  return field<bool>(spec, "add_prefix_space", true, where) ? Prepend::always : Prepend::never;
}

inline char32_t replacement_of(const json& spec, const std::string& where) {
  const auto r = field<std::string>(spec, "replacement", "\xE2\x96\x81", where);
  size_t i = 0;
  if (r.empty() || (next_char(r, i), i != r.size())) refuse(where + ".replacement", "expected one character");
  i = 0;
  return next_char(r, i);
}

inline const std::array<std::string, 256>& byte_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      append_utf8(t[b], static_cast<char32_t>(printable ? b : 256 + n++));
    }
    return t;
  }();
  return table;
}

// The byte a byte-level character stands for, or -1.
inline int char_byte(char32_t c) {
  static const std::array<int, 324> table = [] {
    std::array<int, 324> t;
    t.fill(-1);
    for (int b = 0; b < 256; ++b) {
      size_t i = 0;
      t[next_char(byte_chars()[b], i)] = b;
    }
    return t;
  }();
  return c < table.size() ? table[c] : -1;
}

}  // namespace fsdpp::train::text::detail
