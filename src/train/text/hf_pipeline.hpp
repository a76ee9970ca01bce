#pragma once
// The stages of a Hugging Face tokenizer.json around its model: normalizer, pre-tokenizer and
// decoder, each built from its JSON object. Offsets are not tracked (fsdpp needs ids and text, not
// alignments), which keeps every stage a plain string transform.
//
// Read: normalizers NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, Sequence;
// pre-tokenizers ByteLevel, Split, Digits, Metaspace, Whitespace, WhitespaceSplit, Sequence;
// decoders ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, BPEDecoder, Sequence.
// Anything else is refused by name (std::invalid_argument naming the JSON path).
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace fsdpp::train::text {

// A piece of text on its way to the model. `at_start`: it begins where the whole text began
// (Metaspace's prepend_scheme "first" asks).
struct Piece {
  std::string text;
  bool at_start = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string apply(std::string text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their pre-tokens, in order; empty pre-tokens are dropped.
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

// `where` names the object in the file ("normalizer", "pre_tokenizer.pretokenizers[1]") for
// errors. A JSON null gives nullptr.
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& spec, const std::string& where);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& spec, const std::string& where);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& spec, const std::string& where);

// The byte-level alphabet of GPT-2: each byte as the UTF-8 of the code point standing for it.
const std::string& byte_char(unsigned char byte);

}  // namespace fsdpp::train::text
