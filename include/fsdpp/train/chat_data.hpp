#pragma once
// Conversations as training data (data.source "chat"): JSONL of {"messages": [{"role", "content"}...]}
// or {"prompt", "completion"}, rendered with the tokenizer's own chat template as transformers'
// apply_chat_template renders it, tokenized, and trained on with the loss on the assistant's tokens
// only (the other targets are -100, as transformers' labels). One conversation per sample, padded
// to seq_len + 1: a sample never attends across two conversations (docs/data.md).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp::train {

struct DataOptions;
class Tokenizer;

// A tokenizer's chat template and the special tokens it reads: tokenizer_config.json's
// "chat_template" (or its "default" entry) or chat_template.jinja beside the tokenizer.json, or
// the file `override_path` names. Throws BadInput naming the files looked at when there is none, and
// the template's line when it is outside fsdpp's Jinja subset.
class ChatFormat {
 public:
  ChatFormat(const Tokenizer& tokenizer, const std::string& override_path = "");
  ~ChatFormat();
  ChatFormat(ChatFormat&&) noexcept;

  // The text apply_chat_template(messages, tokenize=False, add_generation_prompt=...) gives, and,
  // when asked, the [begin, end) byte ranges of each assistant turn in it: the template's
  // {% generation %} blocks where it has them, else the text each assistant message adds to the
  // conversation before it with a generation prompt. Throws std::runtime_error with the template's
  // own message for a conversation it refuses.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     std::vector<std::pair<size_t, size_t>>* assistant = nullptr) const;
  const std::string& source() const { return source_; }  // the file the template came from

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string source_;
};

// One conversation's tokens (at most seq_len + 1) and which of them the loss counts as targets.
struct ChatRow {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> counted;  // per token: predicted with loss (an assistant token)
};

class ChatSamples {
 public:
  // Samples are rows in a seeded order per epoch (as TokenStream's windows), each padded with `pad`.
  ChatSamples(std::vector<ChatRow> rows, int64_t seq_len, int32_t pad, uint64_t seed, bool shuffle);
  int64_t rows() const { return static_cast<int64_t>(rows_.size()); }
  // Inputs and targets [count, seq_len] (int64) of samples [first, first + count); a target the
  // loss does not count is -100.
  std::pair<at::Tensor, at::Tensor> samples(int64_t first, int64_t count) const;
  // How many targets samples [first, first + count) count.
  int64_t counted(int64_t first, int64_t count) const;

 private:
  const ChatRow& row_of(int64_t g) const;
  std::vector<ChatRow> rows_;
  int64_t seq_len_;
  int32_t pad_;
  uint64_t seed_;
  bool shuffle_;
};

struct ChatData {
  std::shared_ptr<ChatSamples> train, val;
  std::string
      description;  // "chat: 1,204 conversations from 2 files (61 held out), 312,004 tokens, 41% counted"
};

// One line of a conversations file: "FILE:LINE" (for messages) and its messages.
struct Conversation {
  std::string where;
  nlohmann::ordered_json messages;
};
// A JSONL file's conversations, blank lines skipped: {"messages": [...]}, or {"prompt": ...} with an
// optional "completion" (strings are a user's and an assistant's message). Throws BadInput naming
// the file, line and field.
std::vector<Conversation> read_conversations(const std::string& path);

// Reads data.paths' JSONL files, holds out data.val_fraction of the conversations (seeded), renders
// and tokenizes them. Throws BadInput naming the file, line and field at fault: a line that is not
// JSON, a conversation without messages, a role the template refuses, a conversation longer than
// seq_len + 1 tokens, one with nothing for the loss.
ChatData load_chat(const DataOptions& options, const Tokenizer& tokenizer, uint64_t seed);

}  // namespace fsdpp::train
