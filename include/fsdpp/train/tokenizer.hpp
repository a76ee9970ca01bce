#pragma once
// Tokenizers: text to token ids and back.
//
// "bytes" makes every byte a token (vocabulary 256, no end-of-text token). A SentencePiece model
// file (BPE or unigram, trained by `fsdpp tokenizer train` or SentencePiece's own tools) gives
// learned pieces. Both round-trip exactly: decode(encode(text)) == text for any bytes, including
// text that is not valid UTF-8 (SentencePiece sees only the valid UTF-8 between newlines; newlines,
// stray bytes and literal U+2581 become the model's byte pieces, which a model trained here always
// has).
//
// A Hugging Face tokenizer.json (or a transformers directory holding one), as published models ship
// them, gives exactly the ids of the `tokenizers` package's encode(text, add_special_tokens=False)
// and its decode(ids, skip_special_tokens=False) (docs/data.md lists what is read). Text that is not
// valid UTF-8 is read as Python's bytes.decode("utf-8", "replace") reads it.
//
// A tokenizer is identified by its file's CRC-32C: checkpoints, consolidated files and shard
// indexes record it, so that text is never decoded with a tokenizer other than the one it was
// encoded with.

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fsdpp::train {

class Tokenizer {
 public:
  // "bytes", a tokenizer.json, a directory holding one, or a SentencePiece .model file. Throws
  // BadInput (a std::runtime_error) naming the file, and where in it, when it cannot be read or is
  // not a tokenizer fsdpp reads.
  static std::shared_ptr<const Tokenizer> load(const std::string& spec);

  virtual ~Tokenizer() = default;
  virtual int64_t vocab_size() const = 0;
  // The id that separates documents in token shards; -1 when the tokenizer has none ("bytes").
  virtual int32_t eot() const = 0;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  // "bytes" or the model file's path, as given.
  const std::string& spec() const { return spec_; }
  // The tokenizer.json this tokenizer was read from; empty for "bytes" and SentencePiece.
  const std::string& tokenizer_json() const { return tokenizer_json_; }
  // Whether a model whose embedding has `rows` rows can use this tokenizer: one row per token, or at
  // least one for a tokenizer.json (published models round their embedding up: Qwen2 has 151,936
  // rows for 151,665 tokens).
  bool fits_model(int64_t rows) const {
    return tokenizer_json_.empty() ? vocab_size() == rows : vocab_size() <= rows;
  }
  // "bytes" or "crc32c:<8 hex digits>" of the model file.
  const std::string& hash() const { return hash_; }
  // {"spec": ..., "hash": ..., "vocab_size": ...}: what checkpoints and shard indexes record.
  nlohmann::json identity() const;
  // Throws std::runtime_error when `recorded` (an identity() of something written earlier, in
  // `where`) names another tokenizer: "<where> was written with tokenizer X (crc32c:...), not Y".
  void check_matches(const nlohmann::json& recorded, const std::string& where) const;

 protected:
  std::string spec_, hash_, tokenizer_json_;
};

// encode() of each text, on `threads` threads (0: all cores). Texts of over a MiB are cut at
// newlines into pieces encoded independently where the tokenizer encodes across a newline as on
// either side of it ("bytes", SentencePiece); a tokenizer.json's texts are encoded whole, one per
// thread at a time, since its pre-tokenizer may join a newline to its neighbours.
std::vector<std::vector<int32_t>> encode_all(const Tokenizer& tokenizer, std::span<const std::string> texts,
                                             int threads = 0);

struct TokenizerTrainOptions {
  std::vector<std::string> inputs;  // text files or directories (read recursively)
  std::string output;               // the .model file
  int64_t vocab_size = 2048;
  std::string type = "bpe";                  // bpe | unigram
  double held_out = 0.05;                    // fraction of documents kept out of training, for bytes/token
  int64_t max_training_bytes = 200'000'000;  // sample at most this much text for training
  int threads = 0;                           // 0: all cores
  uint64_t seed = 0;                         // the held-out draw
};

struct TokenizerReport {
  int64_t vocab_size = 0;
  int64_t documents = 0, training_bytes = 0, held_out_bytes = 0, held_out_tokens = 0;
  double seconds = 0;
  double bytes_per_token() const {
    return held_out_tokens ? double(held_out_bytes) / double(held_out_tokens) : 0;
  }
};

// Trains a SentencePiece model on the inputs and writes it atomically to options.output. Progress
// lines ("reading", "training", "measuring") go to `progress`. Throws std::runtime_error naming the
// input or the option at fault.
TokenizerReport train_tokenizer(const TokenizerTrainOptions& options,
                                const std::function<void(const std::string&)>& progress = {});

}  // namespace fsdpp::train
