#include "hf_bpe.hpp"

#include <fmt/format.h>

#include <atomic>
#include <queue>
#include <stdexcept>

#include "unicode.hpp"

namespace fsdpp::train::text {

using nlohmann::json;

namespace {

// Note [words cut before U+2581]
// Without a pre-tokenizer (Llama 2's and Mistral's tokenizer.json: Prepend and Replace normalisers,
// then the model) a whole text is one BPE word: no cache helps, and each merge searches a long heap.
// But where no merge makes a token in which U+2581 follows another character, no merge can join
// the symbols either side of such a place: the merged token would hold that pair. Cutting the word
// there, and before nothing else, changes no merge, so the pieces are encoded (and cached) apart.
// An unknown token cannot fuse across the cut either: U+2581 itself is in the vocabulary (checked).
constexpr std::string_view kMetaspace = "\xE2\x96\x81";

// Whether the character before byte `at` of `s` (at > 0) is not U+2581.
bool other_before(std::string_view s, size_t at) {
  return at < kMetaspace.size() || s.substr(at - kMetaspace.size(), kMetaspace.size()) != kMetaspace;
}

bool metaspace_inside(std::string_view token) {
  for (size_t at = token.find(kMetaspace, 1); at != std::string_view::npos;
       at = token.find(kMetaspace, at + 1))
    if (other_before(token, at)) return true;
  return false;
}

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

std::optional<std::string> optional_string(const json& model, const char* key, const std::string& where) {
  if (!model.contains(key) || model[key].is_null()) return std::nullopt;
  if (!model[key].is_string())
    throw std::invalid_argument(fmt::format("{}.{}: expected a string", where, key));
  return model[key].get<std::string>();
}

bool flag(const json& model, const char* key, const std::string& where) {
  if (!model.contains(key) || model[key].is_null()) return false;
  if (!model[key].is_boolean())
    throw std::invalid_argument(fmt::format("{}.{}: expected true or false", where, key));
  return model[key].get<bool>();
}

// How far past the vocabulary's size an id may be (holes in the numbering).
constexpr int64_t kIdSlack = 65536;

}  // namespace

Bpe::Bpe(const json& model, const std::string& where) {
  static std::atomic<uint64_t> instances{0};
  cache_key_ = ++instances;
  if (!model.contains("vocab") || !model["vocab"].is_object())
    throw std::invalid_argument(fmt::format("{}.vocab: expected an object of token: id", where));
  // Ids index a table of the tokens: one far past the vocabulary's size would make it gigabytes
  // (published vocabularies number their tokens 0 to n - 1).
  const int64_t bound = static_cast<int64_t>(model["vocab"].size()) + kIdSlack;
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      throw std::invalid_argument(fmt::format("{}.vocab[\"{}\"]: id {} is not a non-negative 32-bit integer",
                                              where, token, id.dump()));
    if (id.get<int64_t>() >= bound)
      throw std::invalid_argument(
          fmt::format("{}.vocab[\"{}\"]: id {} is far past the vocabulary's {} tokens (ids "
                      "must be below {})",
                      where, token, id.get<int64_t>(), model["vocab"].size(), bound));
    const auto i = id.get<int32_t>();
    vocab_[token] = i;
    if (static_cast<size_t>(i) >= tokens_.size())
      tokens_.resize(static_cast<size_t>(i) + 1), has_token_.resize(i + 1);
    tokens_[i] = token;
    has_token_[i] = true;
  }
  prefix_ = optional_string(model, "continuing_subword_prefix", where).value_or("");
  suffix_ = optional_string(model, "end_of_word_suffix", where).value_or("");
  fuse_unk_ = flag(model, "fuse_unk", where);
  byte_fallback_ = flag(model, "byte_fallback", where);
  ignore_merges_ = flag(model, "ignore_merges", where);
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
    throw std::invalid_argument(
        fmt::format("{}.dropout: BPE dropout (a training-time augmentation) is not supported; "
                    "set it to null",
                    where));
  if (const auto unk = optional_string(model, "unk_token", where)) {
    const auto it = vocab_.find(*unk);
    if (it == vocab_.end())
      throw std::invalid_argument(fmt::format("{}.unk_token: \"{}\" is not in the vocabulary", where, *unk));
    unk_ = it->second;
  }
  byte_ids_.assign(256, -1);
  for (int b = 0; b < 256; ++b)
    if (const auto it = vocab_.find(fmt::format("<0x{:02X}>", b)); it != vocab_.end())
      byte_ids_[b] = it->second;

  bool metaspace_inside_merge = false;
  const json& merges = model.contains("merges") ? model["merges"] : json::array();
  if (!merges.is_array()) throw std::invalid_argument(fmt::format("{}.merges: expected a list", where));
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& m = merges[rank];
    std::string a, b;
    if (m.is_string()) {  // "a b", the older form
      const auto s = m.get<std::string>();
      const auto space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        throw std::invalid_argument(
            fmt::format("{}.merges[{}]: \"{}\" is not two tokens separated by a space", where, rank, s));
      a = s.substr(0, space), b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    } else {
      throw std::invalid_argument(
          fmt::format("{}.merges[{}]: expected \"a b\" or [\"a\", \"b\"]", where, rank));
    }
    const auto merged = a + (b.starts_with(prefix_) ? b.substr(prefix_.size()) : b);
    const auto ia = vocab_.find(a), ib = vocab_.find(b), im = vocab_.find(merged);
    for (const std::string* token : std::initializer_list<const std::string*>{&a, &b, &merged})
      if (!vocab_.contains(*token))
        throw std::invalid_argument(
            fmt::format("{}.merges[{}]: \"{}\" is not in the vocabulary", where, rank, *token));
    merges_[pair_key(ia->second, ib->second)] = {static_cast<int32_t>(rank), im->second};
    if (metaspace_inside(merged)) metaspace_inside_merge = true;
  }
  cut_before_metaspace_ =
      !metaspace_inside_merge && prefix_.empty() && suffix_.empty() && vocab_.contains(kMetaspace);
}

std::optional<int32_t> Bpe::id(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size() || !has_token_[id]) return nullptr;
  return &tokens_[id];
}

void Bpe::encode(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_)
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  if (!cut_before_metaspace_ || word.size() < 64) return encode_cached(word, out);
  size_t begin = 0;
  for (size_t at = word.find(kMetaspace, 1); at != std::string_view::npos; at = word.find(kMetaspace, at + 1))
    if (other_before(word, at)) {
      encode_cached(word.substr(begin, at - begin), out);
      begin = at;
    }
  encode_cached(word.substr(begin), out);
}

void Bpe::encode_cached(std::string_view word, std::vector<int32_t>& out)
    const {  // Words repeat (Zipf): a per-thread cache, bounded as tokenizers bounds its own.
  struct Cache {
    uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
  };
  thread_local Cache cache;
  constexpr size_t kCapacity = 1 << 16, kLongest = 256;
  if (cache.owner != cache_key_) cache.words.clear(), cache.owner = cache_key_;
  if (const auto it = cache.words.find(word); it != cache.words.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t mark = out.size();
  merge(word, out);
  if (word.size() < kLongest) {
    if (cache.words.size() >= kCapacity) cache.words.clear();
    cache.words.emplace(std::string(word), std::vector<int32_t>(out.begin() + mark, out.end()));
  }
}

void Bpe::merge(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto add = [&](int32_t id) {
    const int n = static_cast<int>(symbols.size());
    symbols.push_back({id, n - 1, n + 1, true});
  };
  int32_t pending_unk = -1;  // an unknown token not yet added (fused with the next unknown ones)
  std::string piece;
  for (size_t i = 0; i < word.size();) {
    const size_t begin = i;
    i += char_bytes(static_cast<unsigned char>(word[i]));
    piece.clear();
    if (begin > 0) piece += prefix_;
    piece.append(word.substr(begin, i - begin));
    if (i == word.size()) piece += suffix_;
    if (const auto it = vocab_.find(piece); it != vocab_.end()) {
      if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
      add(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (const char ch : piece) all &= byte_ids_[static_cast<unsigned char>(ch)] >= 0;
      if (all) {
        // tokenizers adds these without flushing a pending unknown token first.
        for (const char ch : piece) add(byte_ids_[static_cast<unsigned char>(ch)]);
        continue;
      }
    }
    if (unk_ >= 0) {
      if (pending_unk >= 0 && !fuse_unk_) add(pending_unk);
      pending_unk = unk_;
    }
  }
  if (pending_unk >= 0) add(pending_unk);
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank;
    int pos;
    int32_t id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto offer = [&](int left) {
    const int right = symbols[left].next;
    if (right < 0) return;
    if (const auto it = merges_.find(pair_key(symbols[left].id, symbols[right].id)); it != merges_.end())
      queue.push({it->second.rank, left, it->second.id});
  };
  for (int k = 0; k + 1 < static_cast<int>(symbols.size()); ++k) offer(k);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.id != top.id) continue;  // stale
    left.id = top.id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) offer(left.prev);
    offer(top.pos);
  }
  for (const auto& s : symbols)
    if (s.alive) out.push_back(s.id);
}

}  // namespace fsdpp::train::text
