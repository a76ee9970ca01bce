#pragma once
// The BPE model of a Hugging Face tokenizer.json: its vocabulary and ranked merges, byte fallback
// (`<0xNN>` pieces), an unknown token (fused or not), `continuing_subword_prefix`,
// `end_of_word_suffix` and `ignore_merges`, with tokenizers' merge order (lowest rank first, then
// leftmost) and a per-thread cache of words already seen.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fsdpp::train::text {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocabulary = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class Bpe {
 public:
  // `model` is tokenizer.json's "model" object; `where` names it for errors (std::invalid_argument).
  Bpe(const nlohmann::json& model, const std::string& where);

  // Appends the ids of one pre-token.
  void encode(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> id(std::string_view token) const;
  // The token of `id`, or nullptr.
  const std::string* token(int32_t id) const;
  int32_t max_id() const { return static_cast<int32_t>(tokens_.size()) - 1; }

 private:
  void merge(std::string_view word, std::vector<int32_t>& out) const;
  void encode_cached(std::string_view word, std::vector<int32_t>& out) const;

  Vocabulary vocab_;
  std::vector<std::string> tokens_;  // by id; empty where no token has the id
  std::vector<bool> has_token_;
  struct Merge {
    int32_t rank, id;
  };
  std::unordered_map<uint64_t, Merge> merges_;
  std::string prefix_, suffix_;
  int32_t unk_ = -1;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  std::vector<int32_t> byte_ids_;  // <0xNN> for byte fallback; -1 where absent
  // Note [words cut before U+2581]: whether a word may be cut before each U+2581 that follows
  // another character.
  bool cut_before_metaspace_ = false;
  uint64_t cache_key_;
};

}  // namespace fsdpp::train::text
