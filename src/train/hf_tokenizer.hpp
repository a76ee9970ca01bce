#pragma once
// tokenizers' description (tokenizer.json) of fsdpp's tokenizers: the bytes tokenizer, and a
// SentencePiece model trained as fsdpp trains them (byte fallback, no normalisation, no dummy
// prefix): train/hf.hpp's export of a tokenizer, and import's recognition of the first.
#include <nlohmann/json.hpp>
#include <string>

namespace fsdpp::train::hf::detail {

// Throws std::runtime_error naming the file when it is not a SentencePiece model, and
// std::invalid_argument for a word or char model, which tokenizers has no model for.
nlohmann::json piece_tokenizer_json(const std::string& model_path);

// The bytes tokenizer: a byte-level BPE with the 256 bytes as ids and no merges.
nlohmann::json bytes_tokenizer_json();
// Whether `tokenizer_json` describes the bytes tokenizer (as bytes_tokenizer_json() writes it).
bool is_bytes_tokenizer(const nlohmann::json& tokenizer_json);

}  // namespace fsdpp::train::hf::detail
