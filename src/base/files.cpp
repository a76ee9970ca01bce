#include "fsdpp/base/files.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <bit>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace fsdpp {

void write_file_atomically(const std::string& path, const std::string& text) {
  const auto tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) throw std::runtime_error("cannot write " + tmp + " (disk full or not writable?)");
  }
  sync_to_disk(tmp);
  std::filesystem::rename(tmp, path);
}

void sync_to_disk(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path + " to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error("syncing " + path + " to disk failed: " + std::strerror(e));
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error(path + " is missing");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + " is not valid JSON: " + e.what());
  }
}

namespace {

constexpr uint32_t kCastagnoli = 0x82F63B78;  // the polynomial, bit-reversed

// Slicing by 8: table k gives the CRC of a byte followed by k zero bytes, so eight bytes are folded
// per step with eight independent lookups.
constexpr std::array<std::array<uint32_t, 256>, 8> crc_tables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCastagnoli : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  return t;
}
constexpr auto kTables = crc_tables();

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t n, uint32_t crc) {
  uint64_t c = ~crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}
#endif

}  // namespace

namespace detail {

uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (; bytes >= 8; p += 8, bytes -= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    if constexpr (std::endian::native == std::endian::big) lo = __builtin_bswap32(lo), hi = __builtin_bswap32(hi);
    lo ^= c;
    c = kTables[7][lo & 0xff] ^ kTables[6][(lo >> 8) & 0xff] ^ kTables[5][(lo >> 16) & 0xff] ^ kTables[4][lo >> 24] ^
        kTables[3][hi & 0xff] ^ kTables[2][(hi >> 8) & 0xff] ^ kTables[1][(hi >> 16) & 0xff] ^ kTables[0][hi >> 24];
  }
  for (; bytes > 0; ++p, --bytes) c = kTables[0][(c ^ *p) & 0xff] ^ (c >> 8);
  return ~c;
}

}  // namespace detail

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  if (hardware) return crc32c_sse42(static_cast<const unsigned char*>(data), bytes, crc);
#endif
  return detail::crc32c_portable(data, bytes, crc);
}

FileDigest digest_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::vector<char> buffer(4 << 20);
  FileDigest d;
  while (f) {
    f.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto got = static_cast<size_t>(f.gcount());
    d.crc32c = crc32c(buffer.data(), got, d.crc32c);
    d.bytes += got;
  }
  if (f.bad()) throw std::runtime_error("reading " + path + " failed");
  return d;
}

void check_file_digest(const std::string& path, uint64_t bytes, const std::string& crc32c, const std::string& recorded_in) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw std::runtime_error("checkpoint: " + path + " is missing");
  if (size != bytes)
    throw std::runtime_error("checkpoint: " + path + " is " + std::to_string(size) + " bytes, but " + recorded_in +
                             " records " + std::to_string(bytes) + " (cut short or overwritten)");
  const auto got = crc_hex(digest_file(path).crc32c);
  if (got != crc32c)
    throw std::runtime_error("checkpoint: " + path + " is damaged: its CRC-32C is " + got + ", " + recorded_in +
                             " records " + crc32c);
}

std::string crc_hex(uint32_t crc) {
  char s[9];
  std::snprintf(s, sizeof s, "%08x", crc);
  return s;
}

}  // namespace fsdpp
