#pragma once
// Conversations as training data (data.source "chat"): JSONL of {"messages": [{"role", "content"}...]}
// or {"prompt", "completion"}, rendered with the tokenizer's own chat template as transformers'
// apply_chat_template renders it, tokenized, and trained on with the loss on the assistant's tokens
// only (the other targets are -100, as transformers' labels). One conversation per sample, padded
// to seq_len + 1, or, packed (data.pack), several per sample with positions that restart at each
// (models::MoETransformerImpl::set_positions): no token attends to, or predicts, another
// conversation's (docs/data.md).
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

// Inputs and targets [count, seq_len] (int64); a target the loss does not count is -100. Packed:
// the inputs' positions [count, seq_len] (int64), each conversation's from 0 and the padding's too;
// undefined otherwise.
struct ChatBatch {
  at::Tensor inputs, targets, positions;
};

class ChatSamples {
 public:
  // Samples in a seeded order per epoch (as TokenStream's windows), each padded with `pad`: one
  // row each, or with `pack` the rows packed into as few samples of seq_len + 1 tokens as best fit
  // finds, longest row first (TRL's "bfd"), fixed for the run.
  ChatSamples(std::vector<ChatRow> rows, int64_t seq_len, int32_t pad, uint64_t seed, bool shuffle,
              bool pack = false);
  int64_t size() const { return static_cast<int64_t>(samples_.size()); }
  int64_t conversations() const { return static_cast<int64_t>(rows_.size()); }
  bool packed() const { return pack_; }
  // The samples' tokens over their room (samples x (seq_len + 1)).
  double fill() const;
  // Samples [first, first + count), counted from the first epoch's first.
  ChatBatch samples(int64_t first, int64_t count) const;
  // How many targets samples [first, first + count) count.
  int64_t counted(int64_t first, int64_t count) const;

 private:
  const std::vector<uint32_t>& sample_of(int64_t g) const;
  std::vector<ChatRow> rows_;
  std::vector<std::vector<uint32_t>> samples_;  // each sample's rows, in order
  bool pack_;
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

// One conversation rendered by `format` and tokenized (piece by piece at the assistant turns'
// edges). Throws BadInput naming conv.where for a conversation the template refuses and for one
// with nothing for the loss. `info`: the rendered text's bytes, and whether the whole text would
// tokenize otherwise across a turn's edge.
struct ChatRowInfo {
  size_t text_bytes = 0;
  bool split_at_edges = false;
};
ChatRow tokenize_conversation(const ChatFormat& format, const Tokenizer& tokenizer, const Conversation& conv,
                              ChatRowInfo* info = nullptr);

// The conversations of one split ("train" or "val") of a directory `fsdpp tokenize --chat` wrote
// (shards.hpp: kChatMaskExtension), read whole into memory. Throws BadInput naming the directory for
// shards without masks, and the shard and conversation for a mask that disagrees with its shard or a
// conversation longer than max_tokens.
std::vector<ChatRow> read_chat_shards(const std::string& dir, const std::string& split, int64_t vocab_size,
                                      int64_t max_tokens);

// Reads data.paths' JSONL files, holds out data.val_fraction of the conversations (seeded), renders
// and tokenizes them; or, with data.path, the shards of `fsdpp tokenize --chat` (its own split).
// Throws BadInput naming the file, line and field at fault: a line that is not JSON, a
// conversation without messages, a role the template refuses, a conversation longer than
// seq_len + 1 tokens, one with nothing for the loss.
ChatData load_chat(const DataOptions& options, const Tokenizer& tokenizer, uint64_t seed);

}  // namespace fsdpp::train
