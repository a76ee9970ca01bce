#include "fsdpp/train/shards.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <regex>

#include "fsdpp/base/files.hpp"
#include "fsdpp/train/chat_data.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

int32_t read_i32(const unsigned char* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

bool is_shard_name(const std::string& name, const std::string& split) {
  return name.size() > 4 && name.compare(name.size() - 4, 4, ".bin") == 0 &&
         name.find(split) != std::string::npos;
}

}  // namespace

ShardSet::ShardSet(const std::string& dir, const std::string& split, int64_t vocab_size)
    : vocab_size_(vocab_size) {
  try {
    open(dir, split);
  } catch (...) {
    close();  // the destructor does not run for a constructor that throws
    throw;
  }
}

void ShardSet::open(const std::string& dir, const std::string& split) {
  if (!fs::is_directory(dir))
    throw std::runtime_error(fmt::format("data: {} is not a directory of token shards", dir));
  const fs::path index_path = fs::path(dir) / kShardIndexFile;
  std::vector<std::pair<std::string, int64_t>> listed;  // file, tokens the index records (-1: none)
  bool raw = false;
  if (fs::exists(index_path)) {
    if (!fs::is_regular_file(index_path))
      throw std::runtime_error(
          fmt::format("data: {} is {}, not a shard index", index_path.string(), file_kind(index_path)));
    index_ = read_json_file(index_path.string());
    try {
      for (const auto& s : index_.at("shards")) {
        const auto file = s.at("file").get<std::string>();
        if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
          throw std::runtime_error(
              fmt::format("shard file name \"{}\" is not a plain file name in the directory", file));
        const auto& tokens = s.at("tokens");
        // nlohmann converts a float to an integer unchecked: only integers are read as counts.
        if (!tokens.is_number_integer() ||
            (tokens.is_number_unsigned() && tokens.get<uint64_t>() > INT64_MAX) || tokens.get<int64_t>() < 0)
          throw std::runtime_error(
              fmt::format("shard {}: tokens must be a count, got {}", file, tokens.dump()));
        if (s.at("split") == split)
          listed.emplace_back((fs::path(dir) / file).string(), tokens.get<int64_t>());
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format("data: {} is malformed: {}", index_path.string(), e.what()));
    }
  } else if (fs::exists(fs::path(dir) / (split + ".bin"))) {
    raw = true;  // nanoGPT's train.bin / val.bin
    listed.emplace_back((fs::path(dir) / (split + ".bin")).string(), -1);
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (is_shard_name(e.path().filename().string(), split)) listed.emplace_back(e.path().string(), -1);
    std::sort(listed.begin(), listed.end());
  }
  if (listed.empty())
    throw std::runtime_error(
        fmt::format("data: {} holds no {} shards ({}, llm.c's *{}*.bin files or nanoGPT's {}.bin)", dir,
                    split, kShardIndexFile, split, split));
  for (const auto& [path, recorded] : listed) {
    // The mapping outlives the descriptor, which is closed at once: a corpus of thousands of
    // shards holds no descriptors.
    // Regular files only: opening a FIFO blocks until a writer comes, and a device never ends.
    // O_NONBLOCK keeps a FIFO put there after this check from blocking the open.
    if (!fs::is_regular_file(path))
      throw std::runtime_error(
          fmt::format("data: {} is {}, not a shard file (shards are regular files)", path, file_kind(path)));
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw std::runtime_error(fmt::format("data: cannot open {}: {}", path, os_error(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw std::runtime_error(fmt::format("data: {} is not a regular file", path));
    }
    const auto size = static_cast<int64_t>(st.st_size);
    void* m = size > 0 ? ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0) : nullptr;
    const int map_errno = errno;
    ::close(fd);
    if (m == MAP_FAILED)
      throw std::runtime_error(fmt::format("data: cannot map {}: {}", path, std::strerror(map_errno)));
    files_.push_back({.path = path,
                      .map = static_cast<const unsigned char*>(m),
                      .map_bytes = m ? static_cast<size_t>(size) : 0});
    auto& file = files_.back();  // unmapped by close() from here on
    if (m) ::madvise(m, file.map_bytes, MADV_RANDOM);
    if (raw) {
      if (size % 2)
        throw std::runtime_error(
            fmt::format("data: {}: {} bytes is not a whole number of uint16 tokens (cut short at offset {})",
                        path, size, size));
      file.tokens = size / 2;
      layout_ = "uint16, nanoGPT layout";
      continue;
    }
    if (size < kShardHeaderBytes)
      throw std::runtime_error(
          fmt::format("data: {}: {} bytes, shorter than llm.c's {}-byte header (cut short at offset {})",
                      path, size, kShardHeaderBytes, size));
    const int32_t magic = read_i32(file.map), version = read_i32(file.map + 4),
                  count = read_i32(file.map + 8);
    const ShardLayout* layout = magic == kShardU16.magic   ? &kShardU16
                                : magic == kShardU32.magic ? &kShardU32
                                                           : nullptr;
    if (!layout)
      throw std::runtime_error(
          fmt::format("data: {}: magic {} at offset 0 is not llm.c's ({} for uint16 tokens, {} for uint32)",
                      path, magic, kShardU16.magic, kShardU32.magic));
    if (version != layout->version)
      throw std::runtime_error(fmt::format("data: {}: version {} at offset 4; magic {} goes with version {}",
                                           path, version, magic, layout->version));
    file.header = kShardHeaderBytes;
    file.bytes_per_token = layout->bytes_per_token;
    file.tokens = count;
    const int64_t expected = kShardHeaderBytes + int64_t{count} * layout->bytes_per_token;
    if (count < 0 || size != expected)
      throw std::runtime_error(
          fmt::format("data: {}: the header (offset 8) says {} tokens, {} bytes in all, but the file has {} "
                      "bytes ({} at offset {})",
                      path, count, expected, size, size < expected ? "cut short" : "extra bytes",
                      std::min(size, expected)));
    if (recorded >= 0 && recorded != count)
      throw std::runtime_error(fmt::format("data: {}: holds {} tokens but {} records {}", path, count,
                                           index_path.string(), recorded));
    layout_ = layout->bytes_per_token == 2 ? "uint16, llm.c layout" : "uint32, llm.c layout";
  }
}

ShardSet::~ShardSet() { close(); }

void ShardSet::close() {
  for (auto& f : files_)
    if (f.map) ::munmap(const_cast<unsigned char*>(f.map), f.map_bytes);
  files_.clear();
}

int64_t ShardSet::tokens() const {
  int64_t n = 0;
  for (const auto& f : files_) n += f.tokens;
  return n;
}

std::string ShardSet::description() const {
  return fmt::format("{} shard{}, {:.3f} M tokens ({})", files_.size(), files_.size() == 1 ? "" : "s",
                     tokens() / 1e6, layout_);
}

void ShardSet::read(int64_t segment, int64_t offset, int64_t count, int64_t* out) const {
  const auto& f = files_[static_cast<size_t>(segment)];
  const int64_t begin = f.header + offset * f.bytes_per_token;
  const unsigned char* p = f.map + begin;
  for (int64_t i = 0; i < count; ++i, p += f.bytes_per_token) {
    int64_t t;
    if (f.bytes_per_token == 2) {
      uint16_t v;
      std::memcpy(&v, p, 2);
      t = v;
    } else {
      uint32_t v;
      std::memcpy(&v, p, 4);
      t = v;
    }
    if (t >= vocab_size_)
      throw std::runtime_error(
          fmt::format("data: {}: token {} at byte offset {} is outside the model's vocabulary of {}", f.path,
                      t, begin + i * f.bytes_per_token, vocab_size_));
    out[i] = t;
  }
  // The pages go back to the kernel (they stay in its page cache): the process's resident memory
  // stays what one batch needs, however much of the corpus it has visited.
  const auto page = static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  const int64_t first = begin / page * page, end = begin + count * f.bytes_per_token;
  ::madvise(const_cast<unsigned char*>(f.map) + first, static_cast<size_t>(end - first), MADV_DONTNEED);
}

ShardWriter::ShardWriter(std::string path, ShardLayout layout) : layout_(layout), file_(std::move(path)) {
  const std::vector<unsigned char> header(kShardHeaderBytes, 0);  // filled in by close()
  file_.write(header.data(), header.size());
}

void ShardWriter::append(const int32_t* tokens, size_t count) {
  buffer_.resize(count * static_cast<size_t>(layout_.bytes_per_token));
  for (size_t i = 0; i < count; ++i) {
    if (layout_.bytes_per_token == 2) {
      const auto v = static_cast<uint16_t>(tokens[i]);
      std::memcpy(buffer_.data() + 2 * i, &v, 2);
    } else {
      const auto v = static_cast<uint32_t>(tokens[i]);
      std::memcpy(buffer_.data() + 4 * i, &v, 4);
    }
  }
  file_.write(buffer_.data(), buffer_.size());
  tokens_ += static_cast<int64_t>(count);
}

void ShardWriter::close() {
  const int32_t header[3] = {layout_.magic, layout_.version, static_cast<int32_t>(tokens_)};
  file_.write_at(0, header, sizeof header);
  file_.commit();
}

namespace {

// Shards of one split, opened as tokens arrive; with conversations, each shard's mask file beside
// it, cut where the shard is.
class SplitWriter {
 public:
  SplitWriter(const TokenizeOptions& o, std::string split, ShardLayout layout, json& shards, int first_number)
      : o_(o), split_(std::move(split)), layout_(layout), shards_(shards), number_(first_number) {}

  void append(const std::vector<int32_t>& tokens, const std::vector<uint8_t>* mask = nullptr) {
    size_t done = 0;
    while (done < tokens.size()) {
      if (!w_) {
        name_ = fmt::format("{}_{}_{:06d}.bin", o_.name, split_, number_++);
        const auto path = fs::path(o_.output) / name_;
        w_ = std::make_unique<ShardWriter>(path.string(), layout_);
        if (o_.chat)
          mask_ = std::make_unique<AtomicFile>(fs::path(path).replace_extension(kChatMaskExtension).string());
      }
      const size_t n =
          std::min(tokens.size() - done, static_cast<size_t>(o_.tokens_per_shard - w_->tokens()));
      w_->append(tokens.data() + done, n);
      if (mask_) mask_->write(mask->data() + done, n);
      done += n;
      if (w_->tokens() == o_.tokens_per_shard) close();
    }
  }
  void close() {
    if (!w_) return;
    w_->close();
    if (mask_) mask_->commit();
    shards_.push_back({{"file", name_}, {"split", split_}, {"tokens", w_->tokens()}});
    w_.reset();
    mask_.reset();
    ++closed_;
  }
  int shards() const { return closed_; }
  int next_number() const { return number_; }

 private:
  const TokenizeOptions& o_;
  std::string split_;
  ShardLayout layout_;
  json& shards_;
  int number_, closed_ = 0;
  std::string name_;
  std::unique_ptr<ShardWriter> w_;
  std::unique_ptr<AtomicFile> mask_;
};

}  // namespace

TokenizeReport tokenize_to_shards(const Tokenizer& tok, const TokenizeOptions& o,
                                  const std::function<void(const TokenizeProgress&)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.tokens_per_shard < 1 || o.tokens_per_shard > std::numeric_limits<int32_t>::max())
    throw std::runtime_error(
        fmt::format("tokenize: --shard-tokens must be in [1, 2^31), got {}", o.tokens_per_shard));
  // The inputs, in order; sizes first, for the progress bar.
  std::vector<std::string> files;
  int64_t total = 0;
  const auto out_dir = fs::weakly_canonical(o.output);
  const auto inside_output = [&](const std::string& p) {
    const auto rel = fs::weakly_canonical(p).lexically_relative(out_dir);
    return !rel.empty() && *rel.begin() != "..";
  };
  for (const auto& root : o.inputs)
    for (const auto& p : list_text_files(root)) {
      if (inside_output(p)) continue;  // an earlier run's shards, when the output is among the inputs
      files.push_back(p);
      total += static_cast<int64_t>(fs::file_size(p));
    }
  if (files.empty())
    throw std::runtime_error(fmt::format("tokenize: {} holds no files", fmt::join(o.inputs, " ")));

  // The output directory: new, empty, or an earlier run's, whose shards and index are replaced only
  // once this run has succeeded. Until then the new shards wait in a staging directory inside it,
  // removed on failure, so that a run that fails leaves what was there.
  fs::create_directories(o.output);
  constexpr std::string_view kStaging = ".staging-";
  for (const auto& e : fs::directory_iterator(o.output)) {
    const auto name = e.path().filename().string();
    const bool ours =
        name == kShardIndexFile || name.rfind(kStaging, 0) == 0 ||
        (name.rfind(o.name + "_", 0) == 0 && (name.ends_with(".bin") || name.ends_with(".bin.tmp") ||
                                              name.ends_with(".mask") || name.ends_with(".mask.tmp")));
    if (!ours)
      throw std::runtime_error(
          fmt::format("tokenize: {} holds {}, which is not a shard or index of an earlier run: give an "
                      "empty or new directory",
                      o.output, e.path().string()));
    if (name.rfind(kStaging, 0) == 0 || name.ends_with(".tmp"))
      fs::remove_all(e.path());  // left by a killed run
  }
  TokenizeOptions staged = o;
  staged.output = (fs::path(o.output) / fmt::format("{}{}", kStaging, ::getpid())).string();
  fs::create_directories(staged.output);
  struct RemoveStaging {
    std::string dir;
    ~RemoveStaging() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } remove_staging{staged.output};

  const ShardLayout layout = tok.vocab_size() > 65536 ? kShardU32 : kShardU16;
  json shards = json::array();
  SplitWriter val(staged, "val", layout, shards, 0), train(staged, "train", layout, shards, 1);
  TokenizeReport r;
  TokenizeProgress p;
  p.bytes_total = total;
  uint64_t draw = o.seed ^ 0x7E57ull;
  std::optional<ChatFormat> format;
  if (o.chat) format.emplace(tok, o.chat_template);
  // Conversations: one file at a time, each conversation rendered, tokenized and masked in order.
  for (size_t f = 0; o.chat && f < files.size(); ++f) {
    const auto conversations = read_conversations(files[f]);
    for (size_t i = 0; i < conversations.size(); ++i) {
      ChatRowInfo info;
      const ChatRow row = tokenize_conversation(*format, tok, conversations[i], &info);
      std::vector<uint8_t> mask(row.tokens.size());
      for (size_t t = 0; t < mask.size(); ++t)
        mask[t] = uint8_t((row.counted[t] ? kMaskCounted : 0) | (t == 0 ? kMaskStart : 0));
      const bool last = f + 1 == files.size() && i + 1 == conversations.size();
      const bool to_val =
          uniform01(draw) < o.val_fraction || (r.val.documents == 0 && last && r.train.documents > 0);
      (to_val ? val : train).append(row.tokens, &mask);
      auto& split = to_val ? r.val : r.train;
      split.documents += 1;
      split.bytes += static_cast<int64_t>(info.text_bytes);
      split.tokens += static_cast<int64_t>(row.tokens.size());
      p.tokens += static_cast<int64_t>(row.tokens.size());
    }
    p.bytes_done += static_cast<int64_t>(fs::file_size(files[f]));
    p.shards = static_cast<int64_t>(shards.size());
    p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (progress) progress(p);
  }
  // Files are read in batches of about 16 MB, encoded on every core, and written in input order.
  constexpr int64_t kBatchBytes = 16 << 20;
  std::vector<std::string> batch;
  size_t next = o.chat ? files.size() : 0;
  while (next < files.size()) {
    batch.clear();
    int64_t batch_bytes = 0;
    for (; next < files.size() && batch_bytes < kBatchBytes; ++next) {
      std::string text = read_text_file(files[next]);
      p.bytes_done += static_cast<int64_t>(text.size());
      const bool binary = looks_binary(text);
      if (text.empty() || binary) {
        r.skipped_files += binary;
        continue;
      }
      batch_bytes += static_cast<int64_t>(text.size());
      batch.push_back(std::move(text));
    }
    auto encoded = encode_all(tok, batch, o.threads);
    for (size_t d = 0; d < batch.size(); ++d) {
      auto& tokens = encoded[d];
      const auto& text = batch[d];
      // At least one validation document: the last one goes there when none has.
      const bool last = next == files.size() && d + 1 == batch.size();
      const bool to_val =
          uniform01(draw) < o.val_fraction || (r.val.documents == 0 && last && r.train.documents > 0);
      if (tok.eot() >= 0)
        tokens.insert(tokens.begin(), tok.eot());
      else if (text.back() != '\n')
        tokens.push_back('\n');
      auto& split = to_val ? r.val : r.train;
      (to_val ? val : train).append(tokens);
      split.documents += 1;
      split.bytes += static_cast<int64_t>(text.size());
      split.tokens += static_cast<int64_t>(tokens.size());
      p.tokens += static_cast<int64_t>(tokens.size());
      tokens = {};
    }
    p.shards = static_cast<int64_t>(shards.size());
    p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (progress) progress(p);
  }
  val.close();
  train.close();
  if (r.val.documents == 0 || r.train.documents == 0)
    throw std::runtime_error(fmt::format("tokenize: {} gave {} {}; need at least 2 (one for validation)",
                                         fmt::join(o.inputs, " "), r.val.documents + r.train.documents,
                                         o.chat ? "conversations" : "text documents"));
  r.val.shards = val.shards();
  r.train.shards = train.shards();
  const auto split_json = [](const TokenizeReport::Split& s) {
    return json{{"documents", s.documents}, {"bytes", s.bytes}, {"tokens", s.tokens}, {"shards", s.shards}};
  };
  json index = {{"format", "fsdpp.token_shards"},
                {"version", 1},
                {"layout", layout.bytes_per_token == 2 ? "llm.c uint16" : "llm.c uint32"},
                {"tokenizer", tok.identity()},
                {"eot", tok.eot()},
                {"tokens_per_shard", o.tokens_per_shard},
                {"splits", {{"train", split_json(r.train)}, {"val", split_json(r.val)}}},
                {"shards", shards}};
  if (o.chat) index["chat"] = {{"template", format->source()}, {"mask", kChatMaskExtension}};
  // The earlier run's index first (no index ever lists a shard that is gone), then its shards; then
  // this run's shards move in and its index is written.
  fs::remove(fs::path(o.output) / kShardIndexFile);
  for (const auto& e : fs::directory_iterator(o.output))
    if (e.path().filename().string().rfind(kStaging, 0) != 0) fs::remove(e.path());
  for (const auto& shard : shards) {
    const fs::path file = shard.at("file").get<std::string>();
    fs::rename(fs::path(staged.output) / file, fs::path(o.output) / file);
    if (o.chat)
      fs::rename(fs::path(staged.output) / fs::path(file).replace_extension(kChatMaskExtension),
                 fs::path(o.output) / fs::path(file).replace_extension(kChatMaskExtension));
  }
  write_file_atomically((fs::path(o.output) / kShardIndexFile).string(), index.dump(2) + "\n");
  sync_to_disk(o.output);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p.shards = static_cast<int64_t>(shards.size());
  p.seconds = r.seconds;
  if (progress) progress(p);
  return r;
}

}  // namespace fsdpp::train
