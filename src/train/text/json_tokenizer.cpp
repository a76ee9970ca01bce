#include "json_tokenizer.hpp"

#include <fmt/format.h>
#include <utf8proc.h>

#include <filesystem>
#include <optional>
#include <stdexcept>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"
#include "hf_bpe.hpp"
#include "hf_pipeline.hpp"
#include "unicode.hpp"

namespace fsdpp::train::text {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct AddedToken {
  std::string content;   // what the text is matched against (normalised where `normalized`)
  std::string decoded;   // what decode() gives for it
  std::string original;  // as the file writes it
  int32_t id;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Rust's regex \w: alphabetic, marks, decimal digits, connector punctuation, joiners.
bool is_word(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

char32_t last_char(std::string_view s) {
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return next_char(s, start);
}

// Leftmost-longest matching of a few hundred added tokens: candidates by first byte, longest first.
class AddedMatcher {
 public:
  void add(const AddedToken* token) {
    if (token->content.empty()) return;
    auto& list = by_byte_[static_cast<unsigned char>(token->content[0])];
    list.push_back(token);
    std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
      return a->content.size() > b->content.size();
    });
  }
  bool empty() const {
    for (const auto& l : by_byte_)
      if (!l.empty()) return false;
    return true;
  }

  // Calls piece(begin, end) for the text between tokens and token(t) for each token kept, as
  // tokenizers' AddedVocabulary::find_matches cuts a sentence.
  template <class Piece, class Token>
  void cut(std::string_view s, Piece&& piece, Token&& token) const {
    size_t start_offset = 0;
    for (size_t at = 0; at < s.size();) {
      const AddedToken* found = nullptr;
      for (const AddedToken* t : by_byte_[static_cast<unsigned char>(s[at])])
        if (s.compare(at, t->content.size(), t->content) == 0) {
          found = t;
          break;
        }
      if (!found) {
        ++at;
        continue;
      }
      size_t start = at, stop = at + found->content.size();
      at = stop;  // matches do not overlap, kept or not
      if (found->single_word) {
        const bool start_space = start == 0 || !is_word(last_char(s.substr(0, start)));
        size_t k = stop;
        const bool stop_space = stop == s.size() || !is_word(next_char(s, k));
        if (!start_space || !stop_space) continue;
      }
      if (found->lstrip) {
        size_t left = start;
        while (left > 0 && is_whitespace(last_char(s.substr(0, left)))) {
          --left;
          while (left > 0 && (static_cast<unsigned char>(s[left]) & 0xC0) == 0x80) --left;
        }
        start = std::max(left, start_offset);
      }
      if (found->rstrip)
        for (size_t k = stop; k < s.size();) {
          if (!is_whitespace(next_char(s, k))) break;
          stop = k;
        }
      if (start_offset < start) piece(start_offset, start);
      token(*found);
      start_offset = stop;
      at = std::max(at, stop);
    }
    if (start_offset < s.size()) piece(start_offset, s.size());
  }

 private:
  std::vector<const AddedToken*> by_byte_[256];
};

class JsonTokenizer final : public Tokenizer {
 public:
  JsonTokenizer(const std::string& spec, const std::string& file, const json& j) {
    spec_ = spec;
    tokenizer_json_ = file;
    hash_ = "crc32c:" + crc_hex(digest_file(file).crc32c);
    const json& model = j.contains("model") ? j["model"] : json();
    const std::string type = model.is_object() ? model.value("type", std::string("BPE")) : "";
    if (type != "BPE")
      throw std::invalid_argument(
          fmt::format("model: type \"{}\" is not supported: fsdpp reads BPE models (byte-level as GPT-2, "
                      "Llama 3 and Qwen; with "
                      "byte fallback as Llama 2 and Mistral); Unigram, WordPiece and WordLevel are refused",
                      type.empty() ? model.dump() : type));
    bpe_.emplace(model, "model");
    normalizer_ = make_normalizer(j.value("normalizer", json()), "normalizer");
    pre_tokenizer_ = make_pre_tokenizer(j.value("pre_tokenizer", json()), "pre_tokenizer");
    decoder_ = make_decoder(j.value("decoder", json()), "decoder");
    max_id_ = bpe_->max_id();
    const json& added = j.value("added_tokens", json::array());
    if (!added.is_array()) throw std::invalid_argument("added_tokens: expected a list");
    added_.reserve(added.size());  // pointers into it are kept by the matchers
    for (size_t i = 0; i < added.size(); ++i) {
      const auto& t = added[i];
      const auto where = fmt::format("added_tokens[{}]", i);
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string() || t["id"].get<int64_t>() < 0 || t["id"].get<int64_t>() > INT32_MAX)
        throw std::invalid_argument(
            where + ": expected {\"id\": a non-negative integer, \"content\": a string, ...}");
      const auto flag = [&](const char* key, bool fallback) {
        return t.contains(key) && t[key].is_boolean() ? t[key].get<bool>() : fallback;
      };
      AddedToken a{t["content"].get<std::string>(),
                   {},
                   {},
                   t["id"].get<int32_t>(),
                   flag("single_word", false),
                   flag("lstrip", false),
                   flag("rstrip", false),
                   flag("normalized", true),
                   flag("special", false)};
      a.original = a.content;
      // tokenizers matches a normalised token's normalised form, and decodes it to that form too.
      if (a.normalized && normalizer_) a.content = normalizer_->apply(a.content);
      a.decoded = a.content;
      max_id_ = std::max(max_id_, a.id);
      added_.push_back(std::move(a));
    }
    for (const auto& a : added_) {
      (a.normalized ? normalized_matcher_ : raw_matcher_).add(&a);
      by_id_[a.id] = &a;
    }
  }

  void set_eot(int32_t id) { eot_ = id; }
  std::optional<int32_t> id_of(const std::string& token) const {
    for (const auto& a : added_)
      if (a.original == token) return a.id;
    return bpe_->id(token);
  }

  int64_t vocab_size() const override { return int64_t(max_id_) + 1; }
  int32_t eot() const override { return eot_; }

  std::vector<int32_t> encode(std::string_view bytes) const override {
    const std::string text = valid_utf8(bytes);
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 8);
    std::vector<Piece> pieces;
    const auto model = [&](std::string_view piece, bool at_start) {
      pieces.assign(1, Piece{std::string(piece), at_start});
      if (pre_tokenizer_) pre_tokenizer_->apply(pieces);
      for (const auto& p : pieces) bpe_->encode(p.text, out);
    };
    const auto push = [&](const AddedToken& t) { out.push_back(t.id); };
    raw_matcher_.cut(
        text,
        [&](size_t begin, size_t end) {
          const bool at_start = begin == 0;
          std::string segment = text.substr(begin, end - begin);
          if (normalizer_) segment = normalizer_->apply(std::move(segment));
          normalized_matcher_.cut(
              segment,
              [&](size_t b, size_t e) {
                model(std::string_view(segment).substr(b, e - b), at_start && b == 0);
              },
              push);
        },
        push);
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (const auto id : ids) {
      if (const auto it = by_id_.find(id); it != by_id_.end()) {
        tokens.push_back(it->second->decoded);
      } else if (const std::string* t = bpe_->token(id)) {
        tokens.push_back(*t);
      }  // else nothing, as tokenizers drops an id it has no token for (a padded embedding's rows)
    }
    if (decoder_) decoder_->apply(tokens);
    std::string out;
    for (size_t k = 0; k < tokens.size(); ++k) {
      if (!decoder_ && k) out.push_back(' ');
      out += tokens[k];
    }
    return out;
  }

 private:
  std::optional<Bpe> bpe_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<AddedToken> added_;
  std::unordered_map<int32_t, const AddedToken*> by_id_;
  AddedMatcher raw_matcher_, normalized_matcher_;
  int32_t max_id_ = -1, eot_ = -1;
};

// A token named by a config: "..." or {"content": "..."}.
std::optional<std::string> token_name(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return std::nullopt;
}

// The end-of-sequence token: tokenizer_config.json's eos_token, else special_tokens_map.json's,
// else generation_config.json's eos_token_id (the first where it lists several).
int32_t find_eos(const JsonTokenizer& tok, const fs::path& dir) {
  for (const char* name : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const auto path = dir / name;
    if (!fs::is_regular_file(path)) continue;
    const json config = read_json_file(path.string());
    if (!config.is_object() || !config.contains("eos_token")) continue;
    if (const auto token = token_name(config["eos_token"])) {
      if (const auto id = tok.id_of(*token)) return *id;
      throw BadInput(
          fmt::format("{}: eos_token \"{}\" is not in the tokenizer's vocabulary", path.string(), *token));
    }
  }
  if (const auto path = dir / "generation_config.json"; fs::is_regular_file(path)) {
    const json config = read_json_file(path.string());
    const json eos = config.is_object() ? config.value("eos_token_id", json()) : json();
    if (eos.is_number_integer()) return eos.get<int32_t>();
    if (eos.is_array() && !eos.empty() && eos[0].is_number_integer()) return eos[0].get<int32_t>();
  }
  return -1;
}

}  // namespace

std::shared_ptr<const Tokenizer> load_json_tokenizer(const std::string& spec) {
  const fs::path given(spec);
  const fs::path file = fs::is_directory(given) ? given / "tokenizer.json" : given;
  const std::string path = file.string();
  if (fs::is_directory(given) && !fs::exists(file))
    throw BadInput(fmt::format("tokenizer {}: the directory has no tokenizer.json", spec));
  json j;
  try {
    j = read_json_file(path);
  } catch (const std::runtime_error& e) {
    throw BadInput(fmt::format("tokenizer {}", e.what()));
  }
  if (!j.is_object()) throw BadInput(fmt::format("tokenizer {}: expected a JSON object", path));
  std::shared_ptr<JsonTokenizer> tok;
  try {
    tok = std::make_shared<JsonTokenizer>(spec, path, j);
  } catch (const std::invalid_argument& e) {
    throw BadInput(fmt::format("tokenizer {}: {}", path, e.what()));
  }
  tok->set_eot(find_eos(*tok, file.parent_path().empty() ? fs::path(".") : file.parent_path()));
  return tok;
}

}  // namespace fsdpp::train::text
