#include "generate_command.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fsdpp/base/mkl_vml.hpp"
#include "fsdpp/base/paths.hpp"
#include "fsdpp/train/chat_data.hpp"
#include "fsdpp/train/generate.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::cli {

struct GenerateCommand {
  CLI::App* command = nullptr;
  std::string path, prompt, conversations, tokenizer;
  std::vector<std::string> stops;
  bool chat = false;
  int64_t seed = 0;
  train::SampleOptions sample;
};

namespace {

// `fsdpp generate --chat --conversations FILE`: each conversation of a JSONL file continued with
// the assistant's reply, written to stdout as JSONL, one line per conversation.
void continue_conversations(const std::string& file, models::MoETransformerImpl& model,
                            const train::Tokenizer& tokenizer, const train::SampleOptions& sample) {
  const train::ChatFormat format(tokenizer);
  for (auto& [where, messages] : train::read_conversations(file)) {
    std::string prompt;
    try {
      prompt = format.render(messages, /*add_generation_prompt=*/true);
    } catch (const std::runtime_error& e) {
      throw BadInput(fmt::format("{}: chat template {}: {}", where, format.source(), e.what()));
    }
    messages.push_back(
        {{"role", "assistant"}, {"content", train::generate(model, tokenizer, prompt, sample)}});
    std::cout << nlohmann::ordered_json{{"messages", messages}}.dump(
                     -1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
              << std::endl;
  }
}

}  // namespace

std::shared_ptr<GenerateCommand> add_generate_command(CLI::App& app) {
  auto c = std::make_shared<GenerateCommand>();
  auto& sample = c->sample;
  auto* cmd_generate = c->command = app.add_subcommand("generate", "sample text from a trained model");
  cmd_generate
      ->add_option("checkpoint", c->path, "run directory, checkpoint directory or consolidated .safetensors")
      ->required()
      ->check(CLI::ExistingPath);
  cmd_generate->add_option("--prompt", c->prompt, "text to continue");
  cmd_generate
      ->add_option("--max-new-tokens,--tokens,--bytes", sample.max_new_tokens,
                   "tokens to generate (bytes, with the bytes tokenizer)")
      ->check(CLI::Range(1, 100000));
  cmd_generate->add_option("--temperature", sample.temperature, "0: greedy; else in (0, 10]")
      ->check(CLI::Validator(
          [](std::string& v) {
            char* end = nullptr;
            const double t = std::strtod(v.c_str(), &end);  // (subnormal values too, which std::stod refuses)
            if (v.empty() || *end != '\0') return std::string("not a number: ") + v;
            return std::isfinite(t) && t >= 0 && t <= 10 ? std::string()
                                                         : "must be 0 (greedy) or in (0, 10], got " + v;
          },
          "0 TO 10"));
  cmd_generate->add_option("--top-k", sample.top_k, "sample among the k likeliest tokens (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 31));
  cmd_generate
      ->add_option("--top-p", sample.top_p,
                   "sample among the fewest likeliest tokens whose probability reaches p (1: all)")
      ->check(CLI::Validator(
          [](std::string& v) {
            char* end = nullptr;
            const double p = std::strtod(v.c_str(), &end);
            return !v.empty() && *end == '\0' && p > 0 && p <= 1 ? std::string()
                                                                 : "must be in (0, 1], got " + v;
          },
          "(0, 1]"));
  cmd_generate->add_flag(
      "--chat", c->chat,
      "--prompt is a user's message: apply the tokenizer's chat template, print the reply");
  cmd_generate
      ->add_option("--conversations", c->conversations,
                   "with --chat: a JSONL file of conversations ({\"messages\": [...]} or {\"prompt\": ...}); "
                   "each is written back as JSONL with the assistant's reply appended")
      ->check(CLI::ExistingFile);
  cmd_generate->add_option("--stop", c->stops,
                           "a token that ends the continuation besides the end-of-text token (repeatable; "
                           "each must be one token of the tokenizer, such as <|im_end|>)");
  cmd_generate->add_option("--tokenizer", c->tokenizer,
                           "the tokenizer (.model, tokenizer.json or its directory), where it has moved "
                           "since training (its contents "
                           "must be the same)");

  // The text itself is checked: a conversion would clamp a number past the range to its end.
  cmd_generate->add_option("--seed", c->seed, "sampling seed (0 to 2^63 - 1)")
      ->check(
          [](const std::string& text) {
            int64_t v = 0;
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
            return ec == std::errc() && end == text.data() + text.size() && v >= 0
                       ? std::string()
                       : fmt::format("{} is not a whole number from 0 to 2^63 - 1", text);
          },
          "0 to 2^63 - 1");

  return c;
}

int run_generate_command(const GenerateCommand& c) {
  if (!c.command->parsed()) return -1;
  train::SampleOptions sample = c.sample;
  sample.seed = static_cast<uint64_t>(c.seed);
  resolve_mkl_vml_kernels();  // Note [MKL vector math's first calls]: before ATen's intra-op threads compute
  nlohmann::json recorded;
  auto model = train::load_model(c.path, &recorded);
  if (recorded.is_null() && c.tokenizer.empty())
    throw std::invalid_argument(fmt::format(
        "{}: its tokenizer is not one fsdpp reads (bytes, a SentencePiece .model or a tokenizer.json): "
        "give --tokenizer",
        c.path));
  const auto spec = c.tokenizer.empty() ? recorded.value("spec", std::string("bytes")) : c.tokenizer;
  if (spec == "none")
    throw std::runtime_error(
        fmt::format("{} was trained on token shards without a tokenizer (data.tokenizer \"none\"): "
                    "nothing can decode its tokens",
                    c.path));
  const auto tokenizer = train::Tokenizer::load(spec);
  if (!recorded.is_null()) tokenizer->check_matches(recorded, c.path);
  for (const auto& stop : c.stops) {
    const auto ids = tokenizer->encode(stop);
    if (ids.size() != 1)
      throw BadInput(fmt::format("--stop \"{}\" is {} tokens of {}, not one", stop, ids.size(), spec));
    sample.stop_ids.push_back(ids.front());
  }
  if (!c.conversations.empty()) {
    if (!c.chat) throw BadInput("generate: --conversations needs --chat");
    continue_conversations(c.conversations, *model, *tokenizer, sample);
    return 0;
  }
  std::string prompt = c.prompt;
  if (c.chat)
    prompt = train::ChatFormat(*tokenizer)
                 .render(nlohmann::ordered_json::array({{{"role", "user"}, {"content", c.prompt}}}),
                         /*add_generation_prompt=*/true);
  const auto text = train::generate(*model, *tokenizer, prompt, sample);  // before any output
  std::cout << (c.chat ? std::string() : c.prompt) << text << std::endl;
  return 0;
}

}  // namespace fsdpp::cli
