#pragma once
// What the hostile-input tests share: temporary files left behind, and a small file system to fill.
#include <fmt/format.h>
#include <sys/mount.h>
#include <sys/statvfs.h>

#include <filesystem>
#include <string>
#include <vector>

#include "train/run_helpers.hpp"

namespace fsdpp::test {

namespace fs = std::filesystem;

// Files and directories under `dir` that a writer leaves while it works (name.tmp, .tmp-*).
inline std::vector<std::string> temporary_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.path().extension() == ".tmp" || e.path().filename().string().rfind(".tmp-", 0) == 0)
      out.push_back(e.path());
  return out;
}

// A small file system of its own (tmpfs), to fill; unmounted at the end.
struct SmallDisk {
  std::string path;
  bool mounted = false;
  explicit SmallDisk(const std::string& name, const char* size = "8m") : path(fresh_dir(name)) {
    fs::create_directories(path);
    mounted = ::mount("tmpfs", path.c_str(), "tmpfs", 0, fmt::format("size={}", size).c_str()) == 0;
  }
  ~SmallDisk() {
    if (mounted) ::umount2(path.c_str(), MNT_DETACH);
    fs::remove_all(path);
  }
  // Fills what is left with one file, but `spare` bytes; returns its path.
  std::string fill(uint64_t spare = 0) const {
    const auto filler = path + "/filler";
    struct statvfs st {};
    ::statvfs(path.c_str(), &st);
    const uint64_t free = uint64_t{st.f_bavail} * st.f_frsize,
                   blocks = free > spare ? (free - spare) / 4096 : 0;
    sh(spare ? fmt::format("dd if=/dev/zero of={} bs=4096 count={} 2>/dev/null; sync", filler, blocks)
             : "dd if=/dev/zero of=" + filler + " bs=64k 2>/dev/null; sync");
    return filler;
  }
};

}  // namespace fsdpp::test
