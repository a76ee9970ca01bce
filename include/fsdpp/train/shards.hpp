#pragma once
// Token shards on disk, in llm.c's layout, read memory-mapped.
//
// A shard is a header of 256 little-endian int32 (magic, version, token count, zeros) followed by
// the tokens: uint16 under llm.c's GPT-2 magic and version, uint32 under its Llama 3 ones (for
// vocabularies above 65,536). `fsdpp tokenize` writes a directory of them, `<name>_val_NNNNNN.bin`
// and `<name>_train_NNNNNN.bin`, with an index.json naming every shard, its token count and the
// tokenizer. A directory without an index is read as llm.c's own preparation scripts leave it
// (files named *train*.bin / *val*.bin) or as nanoGPT's (train.bin and val.bin: uint16 tokens and
// no header).
//
// Reading maps each file and copies only the windows a step asks for, handing the pages back to
// the kernel after each copy, so that a process's memory does not grow with the corpus.

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fsdpp/train/data.hpp"

#include "fsdpp/base/files.hpp"

namespace fsdpp::train {

class Tokenizer;

struct ShardLayout {
  int32_t magic, version;
  int bytes_per_token;
};
inline constexpr ShardLayout kShardU16{20240520, 1, 2};  // vocabularies up to 65,536
inline constexpr ShardLayout kShardU32{20240801, 7, 4};  // larger ones
inline constexpr int64_t kShardHeaderBytes = 256 * 4;
inline constexpr const char* kShardIndexFile = "index.json";
// Conversation shards (fsdpp tokenize --chat): beside each NAME.bin a NAME.mask, one byte per token
// and no header: bit 0 set where the token is an assistant's (a counted target), bit 1 where a
// conversation starts.
inline constexpr const char* kChatMaskExtension = ".mask";
inline constexpr uint8_t kMaskCounted = 1, kMaskStart = 2;

// The shards of one split ("train" or "val") of a directory, as a token source: one segment per
// file. Tokens at or above `vocab_size` are an error naming the file and byte offset when read.
class ShardSet final : public TokenSource {
 public:
  // Throws std::runtime_error naming the directory when it holds no shards of the split, and the
  // file and byte offset when a header is not llm.c's, a file is cut short, or a file disagrees
  // with the index.
  ShardSet(const std::string& dir, const std::string& split, int64_t vocab_size);
  ~ShardSet() override;
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  int64_t segments() const override { return static_cast<int64_t>(files_.size()); }
  int64_t segment_tokens(int64_t segment) const override {
    return files_[static_cast<size_t>(segment)].tokens;
  }
  void read(int64_t segment, int64_t offset, int64_t count, int64_t* out) const override;

  int64_t tokens() const;
  const std::string& segment_path(int64_t segment) const { return files_[static_cast<size_t>(segment)].path; }
  // index.json's contents; null for a directory without one.
  // Whether the index says the shards hold conversations (fsdpp tokenize --chat: each shard has a
  // mask file beside it, kChatMaskExtension).
  bool chat() const { return index_.is_object() && index_.contains("chat"); }
  const nlohmann::json& index() const { return index_; }
  // "3 shards, 1.20 G tokens (uint16, llm.c layout)".
  std::string description() const;

 private:
  struct File {
    std::string path;
    const unsigned char* map = nullptr;
    size_t map_bytes = 0;
    int64_t tokens = 0, header = 0;
    int bytes_per_token = 2;
  };
  void open(const std::string& dir, const std::string& split);
  void close();  // unmaps every file

  std::vector<File> files_;
  nlohmann::json index_;
  int64_t vocab_size_;
  std::string layout_;
};

// Writes one shard through <path>.tmp: the header is completed and the file synced and renamed when
// it is closed, so that an interrupted writer leaves no file under a shard's name.
class ShardWriter {
 public:
  // Writes through <path>.tmp (an AtomicFile): a writer not closed, or one whose write failed,
  // leaves nothing behind; failures name the file and the OS's reason.
  ShardWriter(std::string path, ShardLayout layout);
  void append(const int32_t* tokens, size_t count);
  int64_t tokens() const { return tokens_; }
  void close();

 private:
  ShardLayout layout_;
  AtomicFile file_;
  int64_t tokens_ = 0;
  std::vector<unsigned char> buffer_;
};

struct TokenizeOptions {
  std::vector<std::string> inputs;  // text files or directories; every file is a document
  // Conversations instead (JSONL files, chat_data.hpp's read_conversations), rendered with the
  // tokenizer's chat template or `chat_template`'s: every conversation a document, its tokens'
  // loss mask in a file beside each shard (read_chat_shards).
  bool chat = false;
  std::string chat_template;
  std::string output;           // the directory
  std::string name = "tokens";  // shard names: <name>_train_000001.bin
  int64_t tokens_per_shard = 100'000'000;
  double val_fraction = 0.005;  // of documents, drawn with the seed; at least one
  uint64_t seed = 0;
  int threads = 0;  // encoding threads (0: all cores)
};

struct TokenizeReport {
  struct Split {
    int64_t documents = 0, bytes = 0, tokens = 0, shards = 0;
  } train, val;
  int64_t skipped_files = 0;
  double seconds = 0;
};

struct TokenizeProgress {
  int64_t bytes_done = 0, bytes_total = 0, tokens = 0, shards = 0;
  double seconds = 0;
};

// Tokenizes the inputs into shards under options.output (created; it must be empty or hold an
// earlier run's shards, which are replaced). Documents are separated by the tokenizer's
// end-of-text token (a newline for "bytes"); conversations (options.chat) are not, each starting
// where its mask says. index.json is written last.
TokenizeReport tokenize_to_shards(const Tokenizer& tokenizer, const TokenizeOptions& options,
                                  const std::function<void(const TokenizeProgress&)>& progress = {});

}  // namespace fsdpp::train
