// libFuzzer target: a transformers config.json, as `fsdpp import`, `generate DIR` and
// model.init_from read it (hf::import_config), then the config back out (hf::export_config).
// Refusing with std::invalid_argument (a RecipeError is one) is the expected outcome; any other
// exception, a crash or a sanitizer report is a finding.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "fsdpp/train/hf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const nlohmann::json::exception&) {
    return 0;  // not JSON: read_json_file reports that before import_config sees anything
  }
  try {
    const auto config = fsdpp::train::hf::import_config(j, "fuzz/config.json");
    (void)fsdpp::train::hf::export_config(config, at::kFloat);
  } catch (const std::invalid_argument&) {
    return 0;  // refused, naming the field
  }
  return 0;
}
