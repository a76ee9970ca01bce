// Stands in for the SentencePiece plugin where fsdpp is built without SentencePiece
// (FSDPP_WITH_SENTENCEPIECE=OFF, as the GPU check builds it): the byte tokenizer works, a
// tokenizer model says what is missing.
#include <stdexcept>

#include "piece_tokenizer.hpp"

namespace fsdpp::train {

namespace {
constexpr const char* kMissing =
    "this fsdpp was built without SentencePiece (FSDPP_WITH_SENTENCEPIECE=OFF; install libsentencepiece-dev "
    "and configure again), so only the \"bytes\" tokenizer is available";
}

namespace detail {
std::shared_ptr<const Tokenizer> load_piece_tokenizer(const std::string& path) {
  throw std::runtime_error("tokenizer " + path + ": " + kMissing);
}
}  // namespace detail

TokenizerReport train_tokenizer(const TokenizerTrainOptions&,
                                const std::function<void(const std::string&)>&) {
  throw std::runtime_error(std::string("tokenizer train: ") + kMissing);
}

}  // namespace fsdpp::train
