#include "fsdpp/train/data.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "fsdpp/base/paths.hpp"
#include "fsdpp/train/recipe.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;

std::string fortunes_dir() {
  const char* e = std::getenv("FSDPP_FORTUNES_DIR");
  return e && *e ? e : "/usr/share/games/fortunes";
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void seeded_shuffle(std::vector<int64_t>& v, uint64_t seed) {
  uint64_t s = seed;
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[splitmix64(s) % i]);
}

std::string read_text_file(const std::string& p) {
  require_regular_file(p, "data:");
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error(fmt::format("data: cannot read {}", p));
  return {std::istreambuf_iterator<char>(f), {}};
}

bool looks_binary(std::string_view bytes) {
  return bytes.substr(0, 8192).find('\0') != std::string_view::npos;
}

std::string file_kind(const std::string& path) {
  std::error_code ec;
  return kind_of(fs::status(path, ec).type());
}

std::vector<std::string> list_text_files(const std::string& root) {
  std::vector<std::string> out;
  std::error_code ec;
  if (fs::is_regular_file(root, ec)) return {root};
  if (!fs::is_directory(root, ec)) {
    const auto kind = file_kind(root);
    throw std::runtime_error(
        kind == "missing"
            ? fmt::format("data: {} does not exist", root)
            : fmt::format("data: {} is {}, not a text file or a directory of them", root, kind));
  }
  std::vector<std::string> all;
  for (const auto& e : fs::recursive_directory_iterator(root)) all.push_back(e.path().string());
  std::sort(all.begin(), all.end());
  // A file reached twice (through a link) counts once.
  std::set<fs::path> seen;
  for (auto& p : all) {
    const auto real = fs::canonical(p, ec);
    if (ec || fs::is_directory(real, ec)) continue;  // a dangling link; a directory, listed itself
    if (!fs::is_regular_file(real, ec))
      throw std::runtime_error(
          fmt::format("data: {} is {}, not a text file: reading it would block or never end; "
                      "move it out of {}",
                      p, file_kind(p), root));
    if (seen.insert(real).second) out.push_back(std::move(p));
  }
  return out;
}

int64_t permute_index(int64_t i, int64_t n, uint64_t key) {
  // A four-round Feistel network on the smallest even number of bits that covers n, walking the
  // cycle until the value falls inside [0, n) (fewer than four rounds of walking on average).
  int bits = 2;
  while ((int64_t{1} << bits) < n) bits += 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  auto x = static_cast<uint64_t>(i);
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t s = key ^ (right * 0x9E3779B97F4A7C15ull) ^ (round << 56);
      const uint64_t next = left ^ (splitmix64(s) & mask);
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(x);
}

namespace {

// Fortune files hold records separated by lines of a single '%'.
void split_fortunes(const std::string& text, std::vector<std::string>& docs) {
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find("\n%\n", start);
    const size_t stop = end == std::string::npos ? text.size() : end + 1;
    std::string doc = text.substr(start, stop - start);
    if (doc.rfind("%\n", 0) == 0) doc.erase(0, 2);
    if (doc.find_first_not_of(" \t\n") != std::string::npos) docs.push_back(std::move(doc));
    start = end == std::string::npos ? text.size() : end + 3;
  }
}

// Text with structure a small model can learn: sentences from a fixed vocabulary of words with
// skewed frequencies, and a few recurring phrases.
std::vector<std::string> synthetic_documents(int64_t bytes, uint64_t seed) {
  static const char* words[] = {"the",      "a",     "model", "shard", "gradient", "of",    "and",
                                "rank",     "sends", "to",    "every", "expert",   "token", "routes",
                                "pipeline", "stage", "is",    "waits", "for",      "its",   "peer",
                                "loss",     "falls", "step",  "by"};
  constexpr size_t n = std::size(words);
  uint64_t s = seed ^ 0x5eed;
  std::vector<std::string> docs;
  int64_t total = 0;
  while (total < bytes) {
    std::string d;
    const int sentences = 1 + int(splitmix64(s) % 4);
    for (int i = 0; i < sentences; ++i) {
      const int len = 3 + int(splitmix64(s) % 8);
      for (int w = 0; w < len; ++w) {
        const uint64_t r = splitmix64(s) % (n * n);
        std::string word = words[static_cast<size_t>(std::sqrt(double(r)))];  // low indices more often
        if (w == 0) word[0] = static_cast<char>(std::toupper(word[0]));
        d += word + (w + 1 < len ? " " : ".\n");
      }
    }
    total += static_cast<int64_t>(d.size());
    docs.push_back(std::move(d));
  }
  return docs;
}

}  // namespace

Corpus load_corpus(const DataOptions& o, uint64_t seed) {
  std::vector<std::string> docs;
  size_t files = 0;
  if (o.source == DataSource::kSynthetic) {
    docs = synthetic_documents(o.synthetic_bytes, seed);
  } else if (o.source == DataSource::kFortunes) {
    const fs::path dir = fortunes_dir();
    if (!fs::is_directory(dir))
      throw std::runtime_error(
          fmt::format("data: the fortunes corpus is not at {} (install Debian's fortunes "
                      "package: bash scripts/setup.sh)",
                      dir.string()));
    for (const auto& p : list_text_files(dir)) {
      // The .dat indexes are binary; .u8 files are symlinks to UTF-8 copies of the same text.
      if (!fs::is_regular_file(fs::symlink_status(p)) || fs::path(p).has_extension()) continue;
      split_fortunes(read_text_file(p), docs);
      ++files;
    }
  } else {
    for (const auto& root : o.paths)
      for (const auto& p : list_text_files(root)) {
        if (!fs::is_regular_file(p)) continue;
        auto text = read_text_file(p);
        if (!text.empty()) docs.push_back(std::move(text));
        ++files;
      }
  }
  if (docs.size() < 2)
    throw std::runtime_error(
        fmt::format("data: source \"{}\" gave {} documents; need at least 2 (one for validation)",
                    name_of(o.source), docs.size()));
  std::vector<int64_t> order(docs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  seeded_shuffle(order, seed ^ 0xD0C5ull);
  const auto n_val = std::clamp<int64_t>(static_cast<int64_t>(double(docs.size()) * o.val_fraction), 1,
                                         static_cast<int64_t>(docs.size()) - 1);
  Corpus c;
  c.documents = static_cast<int64_t>(docs.size());
  c.val_documents = n_val;
  for (size_t i = 0; i < order.size(); ++i) {
    auto& out = static_cast<int64_t>(i) < n_val ? c.val : c.train;
    const auto& d = docs[static_cast<size_t>(order[i])];
    out.insert(out.end(), d.begin(), d.end());
    if (d.back() != '\n') out.push_back('\n');
  }
  c.description = fmt::format("{}: {} documents{}, {:.2f} MB train, {:.2f} MB validation", name_of(o.source),
                              docs.size(), files ? fmt::format(" from {} files", files) : "",
                              c.train.size() / 1e6, c.val.size() / 1e6);
  return c;
}

void MemoryTokens::read(int64_t, int64_t offset, int64_t count, int64_t* out) const {
  std::copy_n(tokens_.data() + offset, count, out);
}

TokenStream::TokenStream(std::shared_ptr<const TokenSource> source, int64_t seq_len, uint64_t seed,
                         bool shuffle)
    : source_(std::move(source)), seq_len_(seq_len), seed_(seed), shuffle_(shuffle) {
  int64_t most = 0;
  for (int64_t s = 0; s < source_->segments(); ++s) {
    first_window_.push_back(windows_);
    const int64_t n = source_->segment_tokens(s);
    most = std::max(most, n);
    windows_ += n > seq_len_ ? (n - 1) / seq_len_ : 0;
  }
  first_window_.push_back(windows_);
  if (windows_ < 1)
    throw std::runtime_error(
        fmt::format("data: {} tokens cannot make one sample of seq_len {} + 1", most, seq_len_));
}

int64_t TokenStream::window_of(int64_t g) const {
  const int64_t epoch = g / windows_, pos = g % windows_;
  if (!shuffle_) return pos;
  return permute_index(pos, windows_, seed_ * 0x100000001B3ull + static_cast<uint64_t>(epoch));
}

at::Tensor TokenStream::samples(int64_t first, int64_t count) const {
  auto out = at::empty({count, seq_len_ + 1}, at::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i, p += seq_len_ + 1) {
    const int64_t w = window_of(first + i);
    const auto seg =
        std::upper_bound(first_window_.begin(), first_window_.end(), w) - first_window_.begin() - 1;
    source_->read(seg, (w - first_window_[static_cast<size_t>(seg)]) * seq_len_, seq_len_ + 1, p);
  }
  return out;
}

}  // namespace fsdpp::train
