// libFuzzer target: the token-shard reader (train::ShardSet), the input a run takes from
// `data.path`. The first byte picks what the rest becomes: the shard index (index.json) beside a
// valid shard, or a shard file found by its name without an index. A std::runtime_error naming the
// file is the expected outcome for bad input; reading the tokens of what opened must stay in bounds.
// Any other exception, crash or sanitizer report is a finding.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fsdpp/train/shards.hpp"

namespace {

namespace fs = std::filesystem;

fs::path scratch() {
  static const auto dir = [] {
    auto d = fs::temp_directory_path() / ("fsdpp-shards-fuzz-" + std::to_string(getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

// A whole llm.c uint16 shard of `tokens` tokens, each its index modulo 250.
void write_shard(const fs::path& path, int32_t tokens) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const int32_t header[256] = {20240520, 1, tokens};
  f.write(reinterpret_cast<const char*>(header), sizeof header);
  for (int32_t i = 0; i < tokens; ++i) {
    const auto t = static_cast<uint16_t>(i % 250);
    f.write(reinterpret_cast<const char*>(&t), 2);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto dir = scratch();
  for (const auto& e : fs::directory_iterator(dir)) fs::remove_all(e.path());
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    write_shard(dir / "tokens_train_000001.bin", 300);
    std::ofstream(dir / "index.json", std::ios::binary) << body;
  } else {
    std::ofstream(dir / "tokens_train_000001.bin", std::ios::binary) << body;
  }
  try {
    fsdpp::train::ShardSet set(dir.string(), "train", 256);
    std::vector<int64_t> out(64);
    for (int64_t s = 0; s < set.segments(); ++s) {
      const int64_t n = std::min<int64_t>(set.segment_tokens(s), 64);
      set.read(s, 0, n, out.data());
      set.read(s, set.segment_tokens(s) - n, n, out.data());
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
