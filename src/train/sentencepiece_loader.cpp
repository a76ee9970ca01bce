// Opens the SentencePiece plugin on first use (Note [SentencePiece in its own lookup scope],
// piece_tokenizer.hpp).
#include <dlfcn.h>
#include <fmt/format.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "piece_tokenizer.hpp"

namespace fsdpp::train {

namespace {

// The plugin sits beside libfsdpp.so, in the build tree and where both are installed.
std::string plugin_path() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&plugin_path), &info) || !info.dli_fname)
    return FSDPP_SENTENCEPIECE_PLUGIN;
  const std::string self = info.dli_fname;
  const auto slash = self.rfind('/');
  return slash == std::string::npos ? FSDPP_SENTENCEPIECE_PLUGIN
                                    : self.substr(0, slash + 1) + FSDPP_SENTENCEPIECE_PLUGIN;
}

const detail::SentencePiecePlugin& plugin() {
  static const detail::SentencePiecePlugin* loaded = nullptr;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string path = plugin_path();
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!handle) {
      error = fmt::format("opening the SentencePiece plugin failed: {}", dlerror());
      return;
    }
    auto entry =
        reinterpret_cast<decltype(&fsdpp_sentencepiece_plugin)>(dlsym(handle, "fsdpp_sentencepiece_plugin"));
    if (!entry) {
      error = fmt::format("{} has no entry point fsdpp_sentencepiece_plugin", path);
      return;
    }
    loaded = entry();  // the handle stays open for the life of the process
  });
  if (!loaded) throw std::runtime_error(error);
  return *loaded;
}

}  // namespace

namespace detail {

std::shared_ptr<const Tokenizer> load_piece_tokenizer(const std::string& path) { return plugin().load(path); }

}  // namespace detail

TokenizerReport train_tokenizer(const TokenizerTrainOptions& options,
                                const std::function<void(const std::string&)>& progress) {
  return plugin().train(options, progress);
}

}  // namespace fsdpp::train
