#pragma once
// Training data: token sources, and the order in which training visits them.
//
// A source is a read-only sequence of tokens in segments: one segment for a corpus held in memory
// (fortunes, files, synthetic text, tokenized at start), one per file for token shards read from
// disk (train/shards.hpp). Samples are windows of seq_len + 1 tokens starting every seq_len tokens
// inside a segment. Each epoch visits every window once in a seeded order that a keyed bijection
// computes window by window (no table, so a source of billions of tokens costs no memory): sample
// g of the endless sequence is window perm_{g / W}(g % W). A step's global batch is samples
// [step * B, (step + 1) * B), and data-parallel rank r takes the r-th contiguous slice of it: every
// rank computes the same order independently, no rank reads another's samples, and the position in
// the data is just the step number (which makes resuming exact).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fsdpp::train {

struct DataOptions;

// Where Debian's fortunes package keeps its text (FSDPP_FORTUNES_DIR overrides).
std::string fortunes_dir();

// The regular files under `root` (itself, when it is a file), sorted; a file reached again through
// a link is left out. Throws naming a missing root, or one that is neither a regular file nor a
// directory, and naming a FIFO, device or socket under it (reading one would block or never end).
std::vector<std::string> list_text_files(const std::string& root);
// What kind of file `path` is, for messages: "a regular file", "a directory", "a FIFO", "a character
// device", "a block device", "a socket", "missing" (symbolic links followed).
std::string file_kind(const std::string& path);
// A file's bytes. Throws std::runtime_error naming the file when it cannot be read.
std::string read_text_file(const std::string& path);
// Text tools skip binary files: those with a NUL byte in their first 8 KiB.
bool looks_binary(std::string_view bytes);

struct Corpus {
  std::string train, val;  // documents joined, each ending in a newline
  int64_t documents = 0, val_documents = 0;
  std::string description;  // "fortunes: 15,123 documents from 40 files, 4.1 MB"
};

// Throws std::runtime_error naming the path when files are missing or empty.
Corpus load_corpus(const DataOptions& options, uint64_t seed);

// A read-only sequence of tokens in segments.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual int64_t segments() const = 0;
  virtual int64_t segment_tokens(int64_t segment) const = 0;
  // Tokens [offset, offset + count) of a segment, as int64. Throws std::runtime_error when one is
  // not a valid token, naming where it is.
  virtual void read(int64_t segment, int64_t offset, int64_t count, int64_t* out) const = 0;
};

// Tokens held in memory: one segment.
class MemoryTokens final : public TokenSource {
 public:
  explicit MemoryTokens(std::vector<int32_t> tokens) : tokens_(std::move(tokens)) {}
  int64_t segments() const override { return 1; }
  int64_t segment_tokens(int64_t) const override { return static_cast<int64_t>(tokens_.size()); }
  void read(int64_t segment, int64_t offset, int64_t count, int64_t* out) const override;

 private:
  std::vector<int32_t> tokens_;
};

class TokenStream {
 public:
  TokenStream(std::shared_ptr<const TokenSource> source, int64_t seq_len, uint64_t seed, bool shuffle = true);
  // A stream over tokens held in memory.
  TokenStream(std::vector<int32_t> tokens, int64_t seq_len, uint64_t seed, bool shuffle = true)
      : TokenStream(std::make_shared<MemoryTokens>(std::move(tokens)), seq_len, seed, shuffle) {}

  int64_t windows() const { return windows_; }
  int64_t seq_len() const { return seq_len_; }
  // Window index of sample g (epoch g / windows(), permuted within the epoch).
  int64_t window_of(int64_t g) const;
  // Samples [first, first + count) as int64 [count, seq_len + 1].
  at::Tensor samples(int64_t first, int64_t count) const;

 private:
  std::shared_ptr<const TokenSource> source_;
  int64_t seq_len_, windows_ = 0;
  uint64_t seed_;
  bool shuffle_;
  std::vector<int64_t> first_window_;  // per segment, then the total
};

// Deterministic shuffles that do not depend on the standard library's implementation.
uint64_t splitmix64(uint64_t& state);
// A draw in [0, 1) from the same generator (held-out and validation documents).
inline double uniform01(uint64_t& state) { return double(splitmix64(state) >> 11) * 0x1.0p-53; }
void seeded_shuffle(std::vector<int64_t>& v, uint64_t seed);
// A keyed bijection of [0, n): the epoch order of TokenStream.
int64_t permute_index(int64_t i, int64_t n, uint64_t key);

}  // namespace fsdpp::train
