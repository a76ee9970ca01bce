// libFuzzer target: SentencePiece tokenizer model files (data.tokenizer, `fsdpp generate
// --tokenizer`), through fsdpp's loader, which reads every piece (byte pieces' "<0xNN>" names,
// control and unknown pieces), then encodes and decodes a text. The model is the input, often a
// mutation of the bundled one. A std::runtime_error naming the file is the expected outcome for a
// bad model; any other exception, crash or sanitizer report is a finding. The plugin's source is
// compiled into the target (instrumented) and its entry called directly.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "../../src/train/piece_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto path = (std::filesystem::temp_directory_path() /
                            ("fsdpp-tokenizer-fuzz-" + std::to_string(getpid()) + ".model"))
                               .string();
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  try {
    const auto tok = fsdpp_sentencepiece_plugin()->load(path);
    const std::string text = "The quick brown fox\n\xE2\x96\x81 jumps \xFF\xFE over\n";
    const auto ids = tok->encode(text);
    if (tok->decode(ids) != text) __builtin_trap();  // byte fallback: every text round-trips
  } catch (const std::runtime_error&) {
  }
  return 0;
}
