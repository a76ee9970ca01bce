#include "fsdpp/files.hpp"

#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace fsdpp {

void write_file_atomically(const std::string& path, const std::string& text) {
  const auto tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) throw std::runtime_error("cannot write " + tmp + " (disk full or not writable?)");
  }
  std::filesystem::rename(tmp, path);
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

}  // namespace fsdpp
