#pragma once
// File helpers shared by checkpoints, the trainer, reports and flight records.

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace fsdpp {

// The operating system's reason for errno `err`, with its name: "No space left on device (ENOSPC)".
std::string os_error(int err);

// Opens `path` (open(2) `flags`, which include O_CREAT or O_TRUNC) to create or rewrite a file in a
// directory a user named: never through a symbolic link (O_NOFOLLOW), never blocking on a FIFO
// (O_NONBLOCK, cleared once open), and only a regular file (fstat). Returns the descriptor; throws
// BadInput (fsdpp/base/paths.hpp) naming the path and what it is ("... is a symbolic link: fsdpp
// writes no file through a link; remove it"), std::runtime_error on the OS's other refusals.
int open_for_writing(const std::string& path, int flags);

// A file written through `path`.tmp and committed under `path` by a rename, so that a reader (or a
// crash) never sees half a file under the final name. Every write is checked: a failure throws
// std::runtime_error naming `path` and the OS's reason ("writing runs/x/summary.json failed: No
// space left on device (ENOSPC)"), and the temporary file is removed, then or when the writer is
// destroyed uncommitted. commit() makes the bytes reach the disk before the rename.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  // Writes at `offset` (a header filled in at the end).
  void write_at(uint64_t offset, const void* data, size_t bytes);
  void commit();
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const char* what, int err);
  std::string path_, tmp_;
  int fd_ = -1;
};

// Writes `text` to `path` as an AtomicFile.
void write_file_atomically(const std::string& path, const std::string& text);

// A log of lines (metrics), each appended whole or not at all: a write that fails part-way is cut
// back to the line before, and the failure throws std::runtime_error naming the file and the OS's
// reason, so that the file never holds a broken line.
class LineLog {
 public:
  // Opens `path` to append (truncate: emptied first).
  LineLog(std::string path, bool truncate);
  ~LineLog();
  LineLog(const LineLog&) = delete;
  LineLog& operator=(const LineLog&) = delete;
  // Appends `line` and a newline.
  void append(std::string_view line);

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Flushes a file's or a directory's contents (a directory: its entries, after renames) to the disk
// (fsync). Throws std::runtime_error naming the path when that fails.
void sync_to_disk(const std::string& path);

// Parses a JSON file. Throws std::runtime_error: "<path> is missing" or "<path> is not valid JSON: ...".
nlohmann::json read_json_file(const std::string& path);

// CRC-32C (Castagnoli, the checksum of iSCSI, ext4 and SSE 4.2's crc32 instruction): `crc` is the
// value of the bytes before `data`, so a file can be summed in pieces. Uses the instruction where
// the processor has it (several GB/s), a table otherwise.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
namespace detail {
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc = 0);  // the table, always
}

// A file's size and CRC-32C, read through once.
struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  bool operator==(const FileDigest&) const = default;
};
// Throws std::runtime_error naming the file when it cannot be read.
FileDigest digest_file(const std::string& path);
// "e3069283": how checksums appear in indexes and messages.
std::string crc_hex(uint32_t crc);

// Checks `path` against the size and CRC-32C (as crc_hex writes it) that `recorded_in` holds for
// it. Throws std::runtime_error "checkpoint: <path> is missing", "... is N bytes, but <recorded_in>
// records M (cut short or overwritten)" or "... is damaged: its CRC-32C is X, <recorded_in> records Y".
void check_file_digest(const std::string& path, uint64_t bytes, const std::string& crc32c,
                       const std::string& recorded_in);

}  // namespace fsdpp
