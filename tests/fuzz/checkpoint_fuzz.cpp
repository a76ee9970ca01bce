// libFuzzer target: the checkpoint readers. The first byte picks what the rest of the input
// becomes: a safetensors file (read_safetensors), or the JSON index of a one-rank checkpoint next to
// a valid safetensors file (read_full_parameters). A std::runtime_error naming the problem is the
// expected outcome for bad input; any other exception, crash or sanitizer report is a finding.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "fsdpp/fsdp/checkpoint.hpp"
#include "fsdpp/base/safetensors.hpp"

namespace {

const std::filesystem::path& scratch() {
  static const auto dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("fsdpp-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    fsdpp::write_safetensors((d / "rank0.safetensors").string(),
                             {{"w", at::arange(12, at::kFloat).view({4, 3})}, {"b", at::ones({4})}});
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& dir = scratch();
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  const bool index = data[0] & 1;
  const auto file = dir / (index ? "rank0.json" : "input.safetensors");
  {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    f << body;
  }
  try {
    if (index)
      fsdpp::fsdp::read_full_parameters(dir.string());
    else
      fsdpp::read_safetensors(file.string());
  } catch (const std::runtime_error&) {
  }
  return 0;
}
