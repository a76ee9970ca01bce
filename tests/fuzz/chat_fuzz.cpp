// libFuzzer target: chat data (data.source "chat") through fsdpp's reader and its chat template
// renderer (src/train/chat_data.cpp and src/train/text/template_*.cpp, compiled in instrumented).
// The first input byte picks what the rest is: even, a JSONL file of conversations rendered with a
// ChatML template; odd, a template rendering two fixed conversations. BadInput and std::runtime_error
// naming the line are the expected outcomes for bad input; any other exception, crash or sanitizer
// report is a finding.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "../../src/train/text/chat_template.hpp"
#include "fsdpp/train/chat_data.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace {

const char* kChatML =
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% "
    "endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

std::string temp(const char* name) {
  return (std::filesystem::temp_directory_path() /
          (std::string("fsdpp-chat-fuzz-") + std::to_string(getpid()) + name))
      .string();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  static const auto tokenizer = fsdpp::train::Tokenizer::load("bytes");
  try {
    if (data[0] % 2 == 0) {
      static const auto jsonl = temp(".jsonl"), chatml = temp(".jinja");
      static const bool wrote = (std::ofstream(chatml) << kChatML, true);
      (void)wrote;
      std::ofstream(jsonl, std::ios::binary | std::ios::trunc) << rest;
      fsdpp::train::DataOptions o;
      o.source = fsdpp::train::DataSource::kChat;
      o.paths = {jsonl};
      o.chat_template = chatml;
      o.seq_len = 512;
      const auto d = fsdpp::train::load_chat(o, *tokenizer, 1);
      const auto b = d.train->samples(0, 2);
      if (b.inputs.size(1) != 512 || b.targets.size(1) != 512) __builtin_trap();
    } else {
      const fsdpp::train::text::ChatTemplate t(rest);
      for (const bool gen : {false, true}) {
        nlohmann::ordered_json v = {{"messages",
                                     {{{"role", "system"}, {"content", "s"}},
                                      {{"role", "user"}, {"content", "Hi {{ x }}"}},
                                      {{"role", "assistant"}, {"content", " yo "}}}},
                                    {"add_generation_prompt", gen},
                                    {"bos_token", "<s>"},
                                    {"eos_token", "</s>"}};
        std::vector<std::pair<size_t, size_t>> generated;
        const auto text = t.render(v, &generated);
        for (const auto& [b, e] : generated)
          if (b > e || e > text.size()) __builtin_trap();  // ranges inside the text
      }
    }
  } catch (const std::runtime_error&) {
  } catch (const std::invalid_argument&) {  // a template outside the subset, named by line
  }
  return 0;
}
