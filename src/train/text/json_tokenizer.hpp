#pragma once
// Hugging Face tokenizers' tokenizer.json, read natively: tokenizer.hpp's Tokenizer::load hands it
// a tokenizer.json file or a transformers directory that holds one.
#include <memory>
#include <string>

#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train::text {

// Throws BadInput naming the file and, inside it, the JSON path at fault.
std::shared_ptr<const Tokenizer> load_json_tokenizer(const std::string& spec);

}  // namespace fsdpp::train::text
