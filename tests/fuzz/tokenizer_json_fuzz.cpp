// libFuzzer target: Hugging Face tokenizer.json files (data.tokenizer, `model.init_from DIR`,
// `fsdpp generate --tokenizer`) through fsdpp's reader (src/train/text/, compiled in instrumented),
// then an encoding and a decoding of hostile text and of the input itself. The file is the input,
// often a mutation of the small byte-level and Metaspace tokenizers run.sh writes. BadInput naming
// the file is the expected outcome for a bad file, std::runtime_error for a pattern PCRE2 gives up
// on; any other exception, crash or sanitizer report is a finding.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "../../src/train/text/json_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto path = (std::filesystem::temp_directory_path() /
                            ("fsdpp-tokenizer-json-fuzz-" + std::to_string(getpid()) + ".json"))
                               .string();
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  try {
    const auto tok = fsdpp::train::text::load_json_tokenizer(path);
    for (const std::string text :
         {std::string("The quick <s> brown\xE2\x96\x81 fox\n\xFF\xFE 12345 \xC3\xA9\xCC\x81 "),
          std::string(reinterpret_cast<const char*>(data), size)}) {
      const auto ids = tok->encode(text);
      for (const auto id : ids)
        if (id < 0 || id >= tok->vocab_size()) __builtin_trap();  // every id names a token
      (void)tok->decode(ids);
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
