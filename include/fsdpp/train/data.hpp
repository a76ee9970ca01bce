#pragma once
// Byte-level data: every byte is a token (vocabulary 256).
//
// A corpus is a list of documents (one fortune, or one file), shuffled once with the seed and split
// into training and validation documents, each side joined into one byte stream. Training samples
// are windows of seq_len + 1 bytes starting every seq_len bytes; each epoch visits every window once
// in a fresh seeded order. Sample g of the endless sequence is window perm_{g / W}[g % W], so a
// step's global batch is samples [step * B, (step + 1) * B) and data-parallel rank r takes the r-th
// contiguous slice of it: every rank computes the same order independently, no rank reads another's
// samples, and the position in the data is just the step number (which makes resuming exact).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdpp::train {

struct DataOptions;

// Where Debian's fortunes package keeps its text (FSDPP_FORTUNES_DIR overrides).
std::string fortunes_dir();

struct Corpus {
  std::vector<uint8_t> train, val;
  int64_t documents = 0, val_documents = 0;
  std::string description;  // "fortunes: 15,123 documents from 40 files, 4.1 MB"
};

// Throws std::runtime_error naming the path when files are missing or empty.
Corpus load_corpus(const DataOptions& options, uint64_t seed);

class TokenStream {
 public:
  TokenStream(std::vector<uint8_t> bytes, int64_t seq_len, uint64_t seed, bool shuffle = true);

  int64_t windows() const { return windows_; }
  int64_t seq_len() const { return seq_len_; }
  // Window index of sample g (epoch g / windows(), shuffled within the epoch).
  int64_t window_of(int64_t g);
  // Samples [first, first + count) as int64 [count, seq_len + 1].
  at::Tensor samples(int64_t first, int64_t count);

 private:
  std::vector<uint8_t> bytes_;
  int64_t seq_len_, windows_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = -1;
  std::vector<int64_t> perm_;
};

// Deterministic shuffles that do not depend on the standard library's implementation.
uint64_t splitmix64(uint64_t& state);
void seeded_shuffle(std::vector<int64_t>& v, uint64_t seed);

}  // namespace fsdpp::train
