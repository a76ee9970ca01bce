#include "hf_pipeline.hpp"

#include <fmt/format.h>

#include <array>
#include <functional>
#include <stdexcept>

#include "hf_fields.hpp"
#include "regex.hpp"
#include "unicode.hpp"

namespace fsdpp::train::text {

using nlohmann::json;
using namespace detail;

namespace {

// ------------------------------------------------------------------ splitting
// A cover of a string by ranges, each a match of the pattern or not (tokenizers' Pattern).
using Cover = std::vector<std::pair<std::pair<size_t, size_t>, bool>>;

Cover cover_of(const Regex& regex, std::string_view s) {
  if (s.empty()) return {{{0, 0}, false}};
  Cover cover;
  size_t previous = 0;
  for (const auto& [begin, end] : regex.find_all(s)) {
    if (previous != begin) cover.push_back({{previous, begin}, false});
    cover.push_back({{begin, end}, true});
    previous = end;
  }
  if (previous != s.size()) cover.push_back({{previous, s.size()}, false});
  return cover;
}

Cover cover_of(const std::function<bool(char32_t)>& is_match, std::string_view s) {
  if (s.empty()) return {{{0, 0}, false}};
  Cover cover;
  size_t last = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t begin = i;
    if (is_match(next_char(s, i))) {
      if (last < begin) cover.push_back({{last, begin}, false});
      cover.push_back({{begin, i}, true});
      last = i;
    }
  }
  if (last < s.size()) cover.push_back({{last, s.size()}, false});
  return cover;
}

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

Behavior behavior_of(const json& spec, const std::string& where) {
  const auto name = field<std::string>(spec, "behavior", "", where);
  if (name == "Removed") return Behavior::removed;
  if (name == "Isolated") return Behavior::isolated;
  if (name == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (name == "MergedWithNext") return Behavior::merged_with_next;
  if (name == "Contiguous") return Behavior::contiguous;
  refuse(where + ".behavior",
         fmt::format("\"{}\" is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous",
                     name));
}

// Appends `piece` cut by `cover` as `behavior` says (tokenizers' NormalizedString::split).
void split_into(const Piece& piece, Cover cover, Behavior behavior, bool invert, std::vector<Piece>& out) {
  if (invert)
    for (auto& c : cover) c.second = !c.second;
  using Range = std::pair<size_t, size_t>;
  std::vector<std::pair<Range, bool>> cuts;  // range, removed
  bool previous_match = false;
  switch (behavior) {
    case Behavior::isolated:
      for (const auto& [r, m] : cover) cuts.push_back({r, false});
      break;
    case Behavior::removed:
      cuts.assign(cover.begin(), cover.end());
      break;
    case Behavior::contiguous:
      for (const auto& [r, m] : cover) {
        if (m == previous_match && !cuts.empty())
          cuts.back().first.second = r.second;
        else
          cuts.push_back({r, false});
        previous_match = m;
      }
      break;
    case Behavior::merged_with_previous:
      for (const auto& [r, m] : cover) {
        if (m && !previous_match && !cuts.empty())
          cuts.back().first.second = r.second;
        else
          cuts.push_back({r, false});
        previous_match = m;
      }
      break;
    case Behavior::merged_with_next:
      for (auto it = cover.rbegin(); it != cover.rend(); ++it) {
        if (it->second && !previous_match && !cuts.empty())
          cuts.back().first.first = it->first.first;
        else
          cuts.push_back({it->first, false});
        previous_match = it->second;
      }
      std::reverse(cuts.begin(), cuts.end());
      break;
  }
  for (const auto& [r, removed] : cuts)
    if (!removed && r.second > r.first)
      out.push_back({piece.text.substr(r.first, r.second - r.first), piece.at_start && r.first == 0});
}

template <class Cut>
void split_each(std::vector<Piece>& pieces, Cut&& cut) {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  for (const auto& piece : pieces) cut(piece, out);
  pieces = std::move(out);
}

// ------------------------------------------------------------------ normalizers
struct FnNormalizer final : Normalizer {
  std::function<std::string(std::string)> fn;
  explicit FnNormalizer(std::function<std::string(std::string)> f) : fn(std::move(f)) {}
  std::string apply(std::string text) const override { return fn(std::move(text)); }
};

std::string strip(std::string text, bool left, bool right) {
  size_t begin = 0, end = text.size();
  if (left)
    for (size_t i = 0; i < text.size();) {
      if (!is_whitespace(next_char(text, i))) break;
      begin = i;
    }
  if (right) {
    // Walk back over whole characters.
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
      size_t i = start;
      if (!is_whitespace(next_char(text, i))) break;
      end = start;
    }
  }
  return text.substr(begin, end - begin);
}

// ------------------------------------------------------------------ pre-tokenizers
struct FnPreTokenizer final : PreTokenizer {
  std::function<void(std::vector<Piece>&)> fn;
  explicit FnPreTokenizer(std::function<void(std::vector<Piece>&)> f) : fn(std::move(f)) {}
  void apply(std::vector<Piece>& pieces) const override { fn(pieces); }
};

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::unique_ptr<PreTokenizer> byte_level(const json& spec, const std::string& where) {
  const bool prefix = field<bool>(spec, "add_prefix_space", true, where);
  const bool use_regex = field<bool>(spec, "use_regex", true, where);
  auto regex = std::make_shared<Regex>(kGpt2Pattern);
  return std::make_unique<FnPreTokenizer>([prefix, use_regex, regex](std::vector<Piece>& pieces) {
    if (prefix)
      for (auto& p : pieces)
        if (p.text.empty() || p.text[0] != ' ') p.text.insert(0, 1, ' ');
    if (use_regex)
      split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        split_into(p, cover_of(*regex, p.text), Behavior::isolated, false, out);
      });
    const auto& chars = byte_chars();
    for (auto& p : pieces) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (const char ch : p.text) mapped += chars[static_cast<unsigned char>(ch)];
      p.text = std::move(mapped);
    }
  });
}

std::unique_ptr<PreTokenizer> metaspace(const json& spec, const std::string& where) {
  const char32_t replacement = replacement_of(spec, where);
  std::string rep;
  append_utf8(rep, replacement);
  const Prepend scheme = prepend_of(spec, where);
  const bool split = field<bool>(spec, "split", true, where);
  return std::make_unique<FnPreTokenizer>([=](std::vector<Piece>& pieces) {
    for (auto& p : pieces) {
      std::string t;
      t.reserve(p.text.size() + rep.size());
      for (const char ch : p.text)
        if (ch == ' ')
          t += rep;
        else
          t.push_back(ch);
      const bool starts = t.compare(0, rep.size(), rep) == 0;
      if (!starts && (scheme == Prepend::always || (scheme == Prepend::first && p.at_start)))
        t.insert(0, rep);
      p.text = std::move(t);
    }
    if (split)
      split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        split_into(p, cover_of([replacement](char32_t c) { return c == replacement; }, p.text),
                   Behavior::merged_with_next, false, out);
      });
  });
}

}  // namespace

const std::string& byte_char(unsigned char byte) { return byte_chars()[byte]; }

std::unique_ptr<Normalizer> make_normalizer(const json& spec, const std::string& where) {
  if (spec.is_null()) return nullptr;
  const auto type = type_of(spec, where);
  const auto form = [](NormalForm f) {
    return std::make_unique<FnNormalizer>([f](std::string s) { return normalize(s, f); });
  };
  if (type == "NFC") return form(NormalForm::nfc);
  if (type == "NFD") return form(NormalForm::nfd);
  if (type == "NFKC") return form(NormalForm::nfkc);
  if (type == "NFKD") return form(NormalForm::nfkd);
  if (type == "Lowercase") return std::make_unique<FnNormalizer>([](std::string s) { return lowercase(s); });
  if (type == "Prepend") {
    const auto prepend = field<std::string>(spec, "prepend", "", where);
    return std::make_unique<FnNormalizer>([prepend](std::string s) { return s.empty() ? s : prepend + s; });
  }
  if (type == "Replace") {
    auto regex = std::make_shared<Regex>(pattern_of(spec, where));
    const auto content = field<std::string>(spec, "content", "", where);
    return std::make_unique<FnNormalizer>(
        [regex, content](std::string s) { return replace_all(*regex, s, content); });
  }
  if (type == "Strip") {
    const bool left = field<bool>(spec, "strip_left", true, where);
    const bool right = field<bool>(spec, "strip_right", true, where);
    return std::make_unique<FnNormalizer>([=](std::string s) { return strip(std::move(s), left, right); });
  }
  if (type == "Sequence") {
    std::vector<std::shared_ptr<Normalizer>> parts;
    const auto& list = spec.value("normalizers", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      if (auto n = make_normalizer(list[i], fmt::format("{}.normalizers[{}]", where, i)))
        parts.push_back(std::move(n));
    return std::make_unique<FnNormalizer>([parts](std::string s) {
      for (const auto& n : parts) s = n->apply(std::move(s));
      return s;
    });
  }
  refuse(where, fmt::format("normalizer \"{}\" is not supported (supported: NFC, NFD, NFKC, NFKD, Lowercase, "
                            "Prepend, Replace, Strip, Sequence)",
                            type));
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& spec, const std::string& where) {
  if (spec.is_null()) return nullptr;
  const auto type = type_of(spec, where);
  if (type == "ByteLevel") return byte_level(spec, where);
  if (type == "Metaspace") return metaspace(spec, where);
  if (type == "Split") {
    auto regex = std::make_shared<Regex>(pattern_of(spec, where));
    const Behavior behavior = behavior_of(spec, where);
    const bool invert = field<bool>(spec, "invert", false, where);
    return std::make_unique<FnPreTokenizer>([=](std::vector<Piece>& pieces) {
      split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        split_into(p, cover_of(*regex, p.text), behavior, invert, out);
      });
    });
  }
  if (type == "Digits") {
    const Behavior behavior =
        field<bool>(spec, "individual_digits", false, where) ? Behavior::isolated : Behavior::contiguous;
    return std::make_unique<FnPreTokenizer>([behavior](std::vector<Piece>& pieces) {
      split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        split_into(p, cover_of(is_numeric, p.text), behavior, false, out);
      });
    });
  }
  if (type == "Whitespace") {
    auto regex = std::make_shared<Regex>(R"(\w+|[^\w\s]+)");
    return std::make_unique<FnPreTokenizer>([regex](std::vector<Piece>& pieces) {
      split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        split_into(p, cover_of(*regex, p.text), Behavior::removed, true, out);
      });
    });
  }
  if (type == "WhitespaceSplit")
    return std::make_unique<FnPreTokenizer>([](std::vector<Piece>& pieces) {
      split_each(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        split_into(p, cover_of(is_whitespace, p.text), Behavior::removed, false, out);
      });
    });
  if (type == "Sequence") {
    std::vector<std::shared_ptr<PreTokenizer>> parts;
    const auto& list = spec.value("pretokenizers", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      if (auto p = make_pre_tokenizer(list[i], fmt::format("{}.pretokenizers[{}]", where, i)))
        parts.push_back(std::move(p));
    return std::make_unique<FnPreTokenizer>([parts](std::vector<Piece>& pieces) {
      for (const auto& p : parts) p->apply(pieces);
    });
  }
  refuse(where,
         fmt::format("pre-tokenizer \"{}\" is not supported (supported: ByteLevel, Split, Digits, Metaspace, "
                     "Whitespace, WhitespaceSplit, Sequence)",
                     type));
}

}  // namespace fsdpp::train::text
