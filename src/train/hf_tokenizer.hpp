#pragma once
// tokenizers' description (tokenizer.json) of a SentencePiece model trained as fsdpp trains them
// (byte fallback, no normalisation, no dummy prefix): train/hf.hpp's export of a tokenizer.
#include <nlohmann/json.hpp>
#include <string>

namespace fsdpp::train::hf::detail {

// Throws std::runtime_error naming the file when it is not a SentencePiece model, and
// std::invalid_argument for a word or char model, which tokenizers has no model for.
nlohmann::json piece_tokenizer_json(const std::string& model_path);

}  // namespace fsdpp::train::hf::detail
