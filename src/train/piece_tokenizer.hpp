#pragma once
// The SentencePiece side of tokenizer.hpp.
//
// Note [SentencePiece in its own lookup scope]
// Debian's libsentencepiece exports gflags-style globals (FLAGS_minloglevel, FLAGS_help,
// FLAGS_version) of its own types, and libc10 exports a FLAGS_minloglevel (an int) too. Loaded the
// usual way, both libraries' references bind to whichever the dynamic linker finds first, libc10's:
// SentencePiece's static initialisers then construct their flag over libc10's int and the bytes
// after it, which set FLAGS_caffe2_use_fatal_for_enforce, so that every failed allocation in the
// process aborted instead of throwing. So SentencePiece lives in a plugin,
// libfsdpp_sentencepiece.so, opened on first use with RTLD_LOCAL | RTLD_DEEPBIND (as the Gloo
// backend is, Note [Gloo in its own lookup scope]): its references and libsentencepiece's resolve in
// the plugin's own dependencies first, and libsentencepiece never enters the global scope.
// tests/comm/test_libraries.cpp checks that LibTorch's flags stay LibTorch's.
//
// sentencepiece_loader.cpp opens the plugin (sentencepiece_tokenizer.cpp) where fsdpp is built with
// SentencePiece; no_sentencepiece.cpp (which says so at run time) stands in where it is not.
#include <functional>
#include <memory>
#include <string>

#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train::detail {

// A SentencePiece .model file with byte fallback. Throws std::runtime_error naming the file.
std::shared_ptr<const Tokenizer> load_piece_tokenizer(const std::string& path);

struct SentencePiecePlugin {
  std::shared_ptr<const Tokenizer> (*load)(const std::string& path);
  TokenizerReport (*train)(const TokenizerTrainOptions& options,
                           const std::function<void(const std::string&)>& progress);
};

}  // namespace fsdpp::train::detail

// Exported by the plugin with C linkage, so that dlsym finds it by this name.
extern "C" const fsdpp::train::detail::SentencePiecePlugin* fsdpp_sentencepiece_plugin();
