// libFuzzer target: the run lock (train::RunLock) over a lock file left with any bytes, as a killed
// run, another program or a hostile user may leave it: taken over with a note that describes the
// holder as far as the bytes allow, rewritten, released. Any exception, a crash or a sanitizer report
// is a finding.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "fsdpp/train/run_lock.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto dir =
      std::filesystem::temp_directory_path() / ("fsdpp-lock-fuzz-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / fsdpp::train::RunLock::kFileName, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  std::optional<std::string> took_over;
  { auto lock = fsdpp::train::RunLock::acquire(dir.string(), "fsdpp run fuzz.json", &took_over); }
  if (size > 0 && (!took_over || took_over->empty())) __builtin_trap();  // a claim left behind is named
  return 0;
}
