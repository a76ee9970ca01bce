// fsdpp's tokenizers as the tokenizer.json that Hugging Face tokenizers (and so transformers'
// AutoTokenizer) reads: the bytes tokenizer as a byte-level BPE, and a SentencePiece .model with
// its pieces read straight from its protobuf, so that no SentencePiece library is needed to export.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "fsdpp/base/paths.hpp"
#include "hf_tokenizer.hpp"

namespace fsdpp::train::hf::detail {

namespace {

using nlohmann::json;

// The few protobuf wire-format readings a ModelProto needs (varints, 32-bit floats, nested
// messages), over a byte range; every read checks the range and throws naming `source`.
class Wire {
 public:
  Wire(std::string_view bytes, const std::string& source) : s_(bytes), source_(source) {}
  bool done() const { return i_ >= s_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (i_ >= s_.size()) fail("a varint runs past the end");
      const auto b = static_cast<unsigned char>(s_[i_++]);
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("a varint is too long");
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > s_.size() - i_) fail("a field runs past the end");
    const auto out = s_.substr(i_, n);
    i_ += n;
    return out;
  }
  float fixed32() {
    if (s_.size() - i_ < 4) fail("a float runs past the end");
    float f;
    std::memcpy(&f, s_.data() + i_, 4);  // little-endian, as x86 and ARM hold it
    i_ += 4;
    return f;
  }
  void skip(uint64_t wire_type) {
    switch (wire_type) {
      case 0:
        varint();
        return;
      case 1:
        advance(8);
        return;
      case 2:
        bytes();
        return;
      case 5:
        advance(4);
        return;
      default:
        fail(fmt::format("wire type {} is not one protobuf writes", wire_type));
    }
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(fmt::format("{}: not a SentencePiece model: {}", source_, what));
  }

 private:
  void advance(size_t n) {
    if (s_.size() - i_ < n) fail("a field runs past the end");
    i_ += n;
  }
  std::string_view s_;
  const std::string& source_;
  size_t i_ = 0;
};

struct Piece {
  std::string text;
  float score = 0;
  int type = 1;  // NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
};

struct Model {
  std::vector<Piece> pieces;
  int type = 1;  // UNIGRAM 1, BPE 2, WORD 3, CHAR 4
};

Model read_model(const std::string& path) {
  require_regular_file(path, "tokenizer");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(fmt::format("{}: cannot be read", path));
  const std::string data((std::istreambuf_iterator<char>(f)), {});
  Model m;
  Wire w(data, path);
  while (!w.done()) {
    const uint64_t key = w.varint();
    const uint64_t field = key >> 3, wire_type = key & 7;
    if (field == 1 && wire_type == 2) {  // repeated SentencePiece pieces
      Wire p(w.bytes(), path);
      Piece piece;
      while (!p.done()) {
        const uint64_t k = p.varint();
        if ((k >> 3) == 1 && (k & 7) == 2)
          piece.text = std::string(p.bytes());
        else if ((k >> 3) == 2 && (k & 7) == 5)
          piece.score = p.fixed32();
        else if ((k >> 3) == 3 && (k & 7) == 0)
          piece.type = static_cast<int>(p.varint());
        else
          p.skip(k & 7);
      }
      m.pieces.push_back(std::move(piece));
    } else if (field == 2 && wire_type == 2) {  // TrainerSpec trainer_spec
      Wire t(w.bytes(), path);
      while (!t.done()) {
        const uint64_t k = t.varint();
        if ((k >> 3) == 3 && (k & 7) == 0)
          m.type = static_cast<int>(t.varint());
        else
          t.skip(k & 7);
      }
    } else {
      w.skip(wire_type);
    }
  }
  if (m.pieces.empty()) w.fail("no pieces");
  return m;
}

json replace(const std::string& from, const std::string& to) {
  return {{"type", "Replace"}, {"pattern", {{"String", from}}}, {"content", to}};
}

constexpr const char* kSpaceMark = "\xE2\x96\x81";  // U+2581

// GPT-2's byte-level alphabet, which tokenizers' ByteLevel pre-tokenizer uses: the printable bytes
// stand for themselves, the others for U+0100 onwards, in byte order.
std::string byte_symbol(int b) {
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  int code = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
    code = 256 + n;
  }
  std::string s;  // UTF-8 of `code` (< 0x800)
  if (code < 0x80) {
    s.push_back(static_cast<char>(code));
  } else {
    s.push_back(static_cast<char>(0xC0 | (code >> 6)));
    s.push_back(static_cast<char>(0x80 | (code & 0x3F)));
  }
  return s;
}

json byte_level(bool with_regex) {
  json j = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}};
  j["use_regex"] = with_regex;
  return j;
}

}  // namespace

// tokenizers' description of the bytes tokenizer: a byte-level BPE with the 256 bytes and no merges.
json bytes_tokenizer_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_symbol(b)] = b;
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level(false)},
          {"post_processor", nullptr},
          {"decoder", byte_level(false)},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", json::array()}}}};
}

bool is_bytes_tokenizer(const json& t) {
  if (!t.is_object() || !t.contains("model") || !t["model"].is_object()) return false;
  const auto& m = t["model"];
  if (m.value("type", "") != "BPE" || !m.contains("vocab") || !m["vocab"].is_object() ||
      m["vocab"].size() != 256)
    return false;
  if (m.contains("merges") && !m["merges"].empty()) return false;
  if (t.contains("added_tokens") && !t["added_tokens"].empty()) return false;
  if (t.contains("normalizer") && !t["normalizer"].is_null()) return false;
  const auto pre = t.value("pre_tokenizer", json());
  if (!pre.is_object() || pre.value("type", "") != "ByteLevel" || pre.value("add_prefix_space", true))
    return false;
  for (int b = 0; b < 256; ++b) {
    const auto it = m["vocab"].find(byte_symbol(b));
    if (it == m["vocab"].end() || *it != b) return false;
  }
  return true;
}

json piece_tokenizer_json(const std::string& model_path) {
  const Model m = read_model(model_path);
  if (m.type != 1 && m.type != 2)
    throw std::invalid_argument(
        fmt::format("{}: a SentencePiece {} model; tokenizers reads BPE and unigram ones", model_path,
                    m.type == 3   ? "word"
                    : m.type == 4 ? "char"
                                  : fmt::format("type-{}", m.type)));
  json added = json::array();
  std::string unk;
  int64_t unk_id = -1;
  for (size_t id = 0; id < m.pieces.size(); ++id) {
    const auto& p = m.pieces[id];
    if (p.type == 2) unk = p.text, unk_id = int64_t(id);
    if (p.type == 2 || p.type == 3)
      added.push_back({{"id", id},
                       {"content", p.text},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
  }
  json model;
  if (m.type == 2) {  // BPE: the pieces, and merges ranked by the piece they make
    json vocab = json::object();
    std::map<std::string, size_t> ids;
    for (size_t id = 0; id < m.pieces.size(); ++id) {
      vocab[m.pieces[id].text] = id;
      if (m.pieces[id].type == 1 || m.pieces[id].type == 4) ids.emplace(m.pieces[id].text, id);
    }
    std::vector<std::tuple<size_t, size_t, size_t, std::string, std::string>> merges;
    for (const auto& [text, id] : ids)
      for (size_t k = 1; k < text.size(); ++k) {
        if ((static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) continue;  // inside a character
        const auto l = ids.find(text.substr(0, k)), r = ids.find(text.substr(k));
        if (l != ids.end() && r != ids.end())
          merges.emplace_back(id, l->second, r->second, l->first, r->first);
      }
    std::sort(merges.begin(), merges.end());
    json list = json::array();
    for (const auto& [id, li, ri, l, r] : merges) list.push_back({l, r});
    model = {{"type", "BPE"},
             {"dropout", nullptr},
             {"unk_token", unk.empty() ? json() : json(unk)},
             {"continuing_subword_prefix", nullptr},
             {"end_of_word_suffix", nullptr},
             {"fuse_unk", true},
             {"byte_fallback", true},
             {"ignore_merges", false},
             {"vocab", vocab},
             {"merges", list}};
  } else {
    json vocab = json::array();
    for (const auto& p : m.pieces) vocab.push_back({p.text, p.score});
    model = {{"type", "Unigram"},
             {"unk_id", unk_id < 0 ? json() : json(unk_id)},
             {"vocab", vocab},
             {"byte_fallback", true}};
  }
  // Spaces are U+2581 inside the model; newlines never reach it (fsdpp gives them byte pieces), so
  // each line is a pre-token of its own.
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", replace(" ", kSpaceMark)},
          {"pre_tokenizer",
           {{"type", "Split"}, {"pattern", {{"String", "\n"}}}, {"behavior", "Isolated"}, {"invert", false}}},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}, replace(kSpaceMark, " ")}}}},
          {"model", model}};
}

}  // namespace fsdpp::train::hf::detail
