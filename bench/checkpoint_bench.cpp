// What checksums cost a checkpoint: a 100 MB shard written and read as a checkpoint writes and
// reads it (safetensors), against the CRC-32C pass that saving adds (digest_file, reading the
// fresh file back) and that loading adds (the same, before the tensors are read). Rounds are
// interleaved; each figure is the median. Files go to DIR (default: the temporary directory), so
// the file system and its page cache are part of what is measured.
//   fsdpp_checkpoint_bench [DIR] [MB] [ROUNDS]
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/safetensors.hpp"

using namespace fsdpp;

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : std::filesystem::temp_directory_path().string();
  const int64_t mb = argc > 2 ? std::stoll(argv[2]) : 100;
  const int rounds = argc > 3 ? std::stoi(argv[3]) : 7;
  // A shard as a checkpoint holds it: parameters and their two optimizer moments.
  const int64_t floats = mb * (1 << 20) / 4 / 3;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const char* name : {"w", "w.exp_avg", "w.exp_avg_sq"}) tensors.emplace_back(name, at::randn({floats}));
  const auto path =
      (std::filesystem::path(dir) / fmt::format("fsdpp-checkpoint-bench-{}.safetensors", ::getpid()))
          .string();
  std::vector<double> write, read, digest, crc_memory, crc_table;
  const auto& bytes = tensors[0].second;
  const size_t n = static_cast<size_t>(bytes.numel()) * 4;
  uint32_t sink = 0;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    write_safetensors(path + ".tmp", tensors);
    std::filesystem::rename(path + ".tmp", path);
    write.push_back(ms_since(t0));
    t0 = std::chrono::steady_clock::now();
    sink ^= digest_file(path).crc32c;
    digest.push_back(ms_since(t0));
    t0 = std::chrono::steady_clock::now();
    const auto file = read_safetensors(path);
    read.push_back(ms_since(t0));
    t0 = std::chrono::steady_clock::now();
    sink ^= crc32c(bytes.data_ptr(), n);
    crc_memory.push_back(ms_since(t0) * 3);  // one tensor of three: scaled to the shard
    if (r < 2) {
      t0 = std::chrono::steady_clock::now();
      sink ^= fsdpp::detail::crc32c_portable(bytes.data_ptr(), n);
      crc_table.push_back(ms_since(t0) * 3);
    }
  }
  std::filesystem::remove(path);
  const double shard_mb = 3.0 * n / 1e6;
  const double w = median(write), d = median(digest), rd = median(read), c = median(crc_memory),
               t = median(crc_table);
  fmt::print("shard: {:.1f} MB in {} ({} rounds, medians; checksum {:08x})\n", shard_mb, dir, rounds, sink);
  fmt::print("| what | ms | MB/s | vs writing the shard |\n|---|---|---|---|\n");
  fmt::print("| write the shard (safetensors, then rename) | {:.1f} | {:.0f} | 1.00x |\n", w,
             shard_mb / w * 1e3);
  fmt::print("| read it back (safetensors) | {:.1f} | {:.0f} | {:.2f}x |\n", rd, shard_mb / rd * 1e3, rd / w);
  fmt::print(
      "| CRC-32C of the file (digest_file: read + sum), added to saving and loading | {:.1f} | {:.0f} | "
      "{:.2f}x |\n",
      d, shard_mb / d * 1e3, d / w);
  fmt::print("| CRC-32C of the bytes in memory (SSE 4.2 crc32) | {:.1f} | {:.0f} | {:.2f}x |\n", c,
             shard_mb / c * 1e3, c / w);
  fmt::print("| CRC-32C in memory, table fallback (no SSE 4.2) | {:.1f} | {:.0f} | {:.2f}x |\n", t,
             shard_mb / t * 1e3, t / w);
  return 0;
}
