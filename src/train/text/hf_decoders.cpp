// tokenizer.json's decoders (hf_pipeline.hpp), as tokenizers applies them.
#include <fmt/format.h>

#include <functional>
#include <memory>

#include "hf_fields.hpp"
#include "hf_pipeline.hpp"
#include "regex.hpp"
#include "unicode.hpp"

namespace fsdpp::train::text {

using nlohmann::json;
using namespace detail;

namespace {

struct FnDecoder final : Decoder {
  std::function<void(std::vector<std::string>&)> fn;
  explicit FnDecoder(std::function<void(std::vector<std::string>&)> f) : fn(std::move(f)) {}
  void apply(std::vector<std::string>& tokens) const override { fn(tokens); }
};

std::vector<char32_t> chars_of(std::string_view s) {
  std::vector<char32_t> out;
  for (size_t i = 0; i < s.size();) out.push_back(next_char(s, i));
  return out;
}

void flush_bytes(std::string& bytes, std::vector<std::string>& out) {
  if (bytes.empty()) return;
  if (valid_utf8(bytes) == bytes)
    out.push_back(bytes);
  else
    for (size_t k = 0; k < bytes.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
  bytes.clear();
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& spec, const std::string& where) {
  if (spec.is_null()) return nullptr;
  const auto type = type_of(spec, where);
  if (type == "ByteLevel")
    return std::make_unique<FnDecoder>([](std::vector<std::string>& tokens) {
      std::string bytes;
      for (const auto& t : tokens) {
        const size_t mark = bytes.size();
        bool all = true;
        for (size_t i = 0; i < t.size() && all;) {
          const int b = char_byte(next_char(t, i));
          if (b < 0)
            all = false;
          else
            bytes.push_back(static_cast<char>(b));
        }
        if (!all) bytes.replace(mark, std::string::npos, t);
      }
      tokens.assign(1, valid_utf8(bytes));
    });
  if (type == "ByteFallback")
    return std::make_unique<FnDecoder>([](std::vector<std::string>& tokens) {
      std::vector<std::string> out;
      std::string bytes;
      for (auto& t : tokens) {
        const int hi = t.size() == 6 && t.starts_with("<0x") && t.back() == '>' ? hex_digit(t[3]) : -1;
        const int lo = hi >= 0 ? hex_digit(t[4]) : -1;
        if (lo >= 0) {
          bytes.push_back(static_cast<char>(hi * 16 + lo));
        } else {
          flush_bytes(bytes, out);
          out.push_back(std::move(t));
        }
      }
      flush_bytes(bytes, out);
      tokens = std::move(out);
    });
  if (type == "Fuse")
    return std::make_unique<FnDecoder>([](std::vector<std::string>& tokens) {
      std::string all;
      for (const auto& t : tokens) all += t;
      tokens.assign(1, std::move(all));
    });
  if (type == "Strip") {
    const auto content =
        replacement_of({{"replacement", field<std::string>(spec, "content", " ", where)}}, where);
    const auto start = field<size_t>(spec, "start", 0, where), stop = field<size_t>(spec, "stop", 0, where);
    return std::make_unique<FnDecoder>([=](std::vector<std::string>& tokens) {
      for (auto& t : tokens) {
        const auto chars = chars_of(t);
        size_t begin = 0, end = chars.size();
        for (size_t i = 0; i < std::min(start, chars.size()) && chars[i] == content; ++i) begin = i + 1;
        for (size_t i = 0; i < stop && i < chars.size() && chars[chars.size() - i - 1] == content; ++i)
          end = chars.size() - i - 1;
        std::string s;
        for (size_t i = begin; i < end; ++i) append_utf8(s, chars[i]);
        t = std::move(s);
      }
    });
  }
  if (type == "Replace") {
    auto regex = std::make_shared<Regex>(pattern_of(spec, where));
    const auto content = field<std::string>(spec, "content", "", where);
    return std::make_unique<FnDecoder>([regex, content](std::vector<std::string>& tokens) {
      for (auto& t : tokens) t = replace_all(*regex, t, content);
    });
  }
  if (type == "Metaspace") {
    const char32_t replacement = replacement_of(spec, where);
    const Prepend scheme = prepend_of(spec, where);
    return std::make_unique<FnDecoder>([=](std::vector<std::string>& tokens) {
      for (size_t k = 0; k < tokens.size(); ++k) {
        std::string s;
        for (const char32_t c : chars_of(tokens[k])) {
          if (c != replacement)
            append_utf8(s, c);
          else if (k != 0 || scheme == Prepend::never)
            s.push_back(' ');
        }
        tokens[k] = std::move(s);
      }
    });
  }
  if (type == "BPEDecoder") {
    const auto suffix = field<std::string>(spec, "suffix", "</w>", where);
    auto regex = std::make_shared<Regex>(suffix, /*literal=*/true);
    return std::make_unique<FnDecoder>([regex](std::vector<std::string>& tokens) {
      for (size_t k = 0; k < tokens.size(); ++k)
        tokens[k] = replace_all(*regex, tokens[k], k + 1 == tokens.size() ? "" : " ");
    });
  }
  if (type == "Sequence") {
    std::vector<std::shared_ptr<Decoder>> parts;
    const auto& list = spec.value("decoders", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      if (auto d = make_decoder(list[i], fmt::format("{}.decoders[{}]", where, i)))
        parts.push_back(std::move(d));
    return std::make_unique<FnDecoder>([parts](std::vector<std::string>& tokens) {
      for (const auto& d : parts) d->apply(tokens);
    });
  }
  refuse(where,
         fmt::format("decoder \"{}\" is not supported (supported: ByteLevel, ByteFallback, Fuse, Strip, "
                     "Replace, Metaspace, BPEDecoder, Sequence)",
                     type));
}

}  // namespace fsdpp::train::text
