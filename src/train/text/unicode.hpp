#pragma once
// UTF-8 and the Unicode character properties that Hugging Face tokenizers consult, as Rust's
// `char` defines them (tokenizers is written in Rust): whitespace, numeric, lower case; the
// normalisation forms come from utf8proc.
#include <cstdint>
#include <string>
#include <string_view>

namespace fsdpp::train::text {

// `bytes` as valid UTF-8: each maximal ill-formed subsequence becomes one U+FFFD, as Rust's
// String::from_utf8_lossy and Python's bytes.decode("utf-8", "replace") do. Returns `bytes`
// unchanged (and cheaply) when it is valid already.
std::string valid_utf8(std::string_view bytes);

// The code point at s[i] in valid UTF-8; advances i past it.
inline char32_t next_char(std::string_view s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) {
    ++i;
    return b;
  }
  const int n = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1;
  char32_t c = b & (0x3F >> n);
  for (int k = 1; k <= n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n + 1;
  return c;
}

// Bytes of the UTF-8 sequence that starts with `lead`.
inline size_t char_bytes(unsigned char lead) {
  return lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
}

void append_utf8(std::string& out, char32_t c);

bool is_whitespace(char32_t c);  // Unicode White_Space (Rust's char::is_whitespace)
bool is_numeric(char32_t c);     // general categories Nd, Nl, No (Rust's char::is_numeric)

enum class NormalForm { nfc, nfd, nfkc, nfkd };
std::string normalize(std::string_view utf8, NormalForm form);
// Each character's full lower-case mapping, one character at a time (Rust's char::to_lowercase).
std::string lowercase(std::string_view utf8);

}  // namespace fsdpp::train::text
