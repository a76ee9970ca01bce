// For fuzz targets that reach the SentencePiece tokenizer through fsdpp's own code (the recipe
// parser checks data.tokenizer's vocabulary): the sanitizer runtime refuses RTLD_DEEPBIND, so
// instead of dlopen-ing libfsdpp_sentencepiece.so (sentencepiece_loader.cpp) the target links the
// plugin's source, instrumented, and these definitions call its entry point directly. run.sh
// compiles tokenizer.cpp into the target too, so that Tokenizer::load binds here and not to
// libfsdpp.so's own loader (which -Bsymbolic-functions keeps out of reach).
#include "../../src/train/piece_tokenizer.hpp"

namespace fsdpp::train {

namespace detail {

std::shared_ptr<const Tokenizer> load_piece_tokenizer(const std::string& path) {
  return fsdpp_sentencepiece_plugin()->load(path);
}

}  // namespace detail

TokenizerReport train_tokenizer(const TokenizerTrainOptions& options,
                                const std::function<void(const std::string&)>& progress) {
  return fsdpp_sentencepiece_plugin()->train(options, progress);
}

}  // namespace fsdpp::train
