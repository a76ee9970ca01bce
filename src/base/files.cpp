#include "fsdpp/base/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
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

#include "fsdpp/base/paths.hpp"

namespace fsdpp {

std::string os_error(int err) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 32)
  if (const char* name = ::strerrorname_np(err)) return std::string(std::strerror(err)) + " (" + name + ")";
#endif
  return std::strerror(err);
}

namespace {

// Writes all of `bytes` (write(2) may write less than asked); returns errno or 0.
int write_all(int fd, const void* data, size_t bytes, const uint64_t* offset = nullptr) {
  const char* p = static_cast<const char*>(data);
  uint64_t at = offset ? *offset : 0;
  while (bytes > 0) {
    const ssize_t n = offset ? ::pwrite(fd, p, bytes, static_cast<off_t>(at)) : ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return ENOSPC;  // nothing written and no error: the device takes no more
    p += n, bytes -= static_cast<size_t>(n), at += static_cast<uint64_t>(n);
  }
  return 0;
}

}  // namespace

int open_for_writing(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int e = errno;
    struct stat st {};
    if (e == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
      throw BadInput(path + " is a symbolic link: fsdpp writes no file through a link; remove it");
    if ((e == ENXIO || e == EISDIR) && ::lstat(path.c_str(), &st) == 0)
      throw BadInput(path + " is " + kind_of_mode(st.st_mode) + ", not a regular file");
    throw std::runtime_error("cannot open " + path + " to write: " + os_error(e));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw std::runtime_error("cannot open " + path + " to write: " + os_error(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw BadInput(path + " is " + kind_of_mode(st.st_mode) + ", not a regular file");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  // A new file, whatever was left under the temporary name (a crash's, or a link someone planted:
  // unlink removes the link, not its target).
  ::unlink(tmp_.c_str());
  try {
    fd_ = open_for_writing(tmp_, O_WRONLY | O_CREAT | O_EXCL);
  } catch (const BadInput& e) {
    throw BadInput("writing " + path_ + " failed: " + e.what());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("writing " + path_ + " failed: " + e.what());
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::fail(const char* what, int err) {
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  throw std::runtime_error("writing " + path_ + " failed" + (*what ? std::string(" (") + what + ")" : "") +
                           ": " + os_error(err));
}

void AtomicFile::write(const void* data, size_t bytes) {
  if (fd_ < 0) throw std::logic_error("AtomicFile " + path_ + ": written after commit or failure");
  if (const int e = write_all(fd_, data, bytes)) fail("", e);
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t bytes) {
  if (fd_ < 0) throw std::logic_error("AtomicFile " + path_ + ": written after commit or failure");
  if (const int e = write_all(fd_, data, bytes, &offset)) fail("", e);
}

void AtomicFile::commit() {
  if (fd_ < 0) throw std::logic_error("AtomicFile " + path_ + ": committed twice or after a failure");
  if (::fsync(fd_) != 0) fail("syncing it to disk", errno);
  if (::close(fd_) != 0) {
    const int e = errno;
    fd_ = -1;
    ::unlink(tmp_.c_str());
    throw std::runtime_error("writing " + path_ + " failed: " + os_error(e));
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp_.c_str());
    throw std::runtime_error("writing " + path_ + " failed (renaming " + tmp_ + "): " + os_error(e));
  }
}

void write_file_atomically(const std::string& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text);
  f.commit();
}

LineLog::LineLog(std::string path, bool truncate) : path_(std::move(path)) {
  fd_ = open_for_writing(path_, O_WRONLY | O_CREAT | (truncate ? O_TRUNC : 0));
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  size_ = end > 0 ? static_cast<uint64_t>(end) : 0;
}

LineLog::~LineLog() {
  if (fd_ >= 0) ::close(fd_);
}

void LineLog::append(std::string_view line) {
  std::string whole;
  whole.reserve(line.size() + 1);
  whole.append(line).push_back('\n');
  if (const int e = write_all(fd_, whole.data(), whole.size(), &size_)) {
    // Part of the line may be there: cut the file back to the lines before it.
    [[maybe_unused]] const int rc = ::ftruncate(fd_, static_cast<off_t>(size_));
    throw std::runtime_error("writing " + path_ + " failed: " + os_error(e));
  }
  size_ += whole.size();
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
  require_regular_file(path, "");
  std::ifstream f(path);
  if (!f) throw std::runtime_error(path + " cannot be read: " + os_error(errno));
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
    if constexpr (std::endian::native == std::endian::big)
      lo = __builtin_bswap32(lo), hi = __builtin_bswap32(hi);
    lo ^= c;
    c = kTables[7][lo & 0xff] ^ kTables[6][(lo >> 8) & 0xff] ^ kTables[5][(lo >> 16) & 0xff] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xff] ^ kTables[2][(hi >> 8) & 0xff] ^
        kTables[1][(hi >> 16) & 0xff] ^ kTables[0][hi >> 24];
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
  require_regular_file(path, "");
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

void check_file_digest(const std::string& path, uint64_t bytes, const std::string& crc32c,
                       const std::string& recorded_in) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw std::runtime_error("checkpoint: " + path + " is missing");
  if (size != bytes)
    throw std::runtime_error("checkpoint: " + path + " is " + std::to_string(size) + " bytes, but " +
                             recorded_in + " records " + std::to_string(bytes) +
                             " (cut short or overwritten)");
  const auto got = crc_hex(digest_file(path).crc32c);
  if (got != crc32c)
    throw std::runtime_error("checkpoint: " + path + " is damaged: its CRC-32C is " + got + ", " +
                             recorded_in + " records " + crc32c);
}

std::string crc_hex(uint32_t crc) {
  char s[9];
  std::snprintf(s, sizeof s, "%08x", crc);
  return s;
}

}  // namespace fsdpp
