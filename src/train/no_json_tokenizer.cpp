// Stands in for src/train/text/ where fsdpp is built without PCRE2 and utf8proc
// (FSDPP_WITH_TOKENIZER_JSON=OFF, as the GPU check builds it): a tokenizer.json says what is missing.
#include <stdexcept>

#include "text/json_tokenizer.hpp"

namespace fsdpp::train::text {

std::shared_ptr<const Tokenizer> load_json_tokenizer(const std::string& spec) {
  throw std::runtime_error(
      "tokenizer " + spec +
      ": this fsdpp was built without PCRE2 and utf8proc (FSDPP_WITH_TOKENIZER_JSON=OFF; install "
      "libpcre2-dev and libutf8proc-dev and configure again), so tokenizer.json files cannot be read");
}

}  // namespace fsdpp::train::text
