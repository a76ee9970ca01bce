// libFuzzer target: the recipe parser and validator. An input is a recipe, optionally followed by a
// line "--" and one dotted override per line. Refusing an input with RecipeError is the expected
// outcome; any other exception, crash or sanitizer report is a finding.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fsdpp/train/recipe.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto cut = text.find("\n--\n");
  std::vector<std::string> overrides;
  if (cut != std::string::npos) {
    std::istringstream rest(text.substr(cut + 4));
    for (std::string line; std::getline(rest, line);) overrides.push_back(line);
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.substr(0, cut));
  } catch (const nlohmann::json::exception&) {
    return 0;  // not JSON: load_recipe reports that before the parser sees anything
  }
  try {
    fsdpp::train::parse_recipe(std::move(j), "fuzz.json", FSDPP_SOURCE_DIR "/recipes", overrides,
                               std::nullopt);
  } catch (const fsdpp::train::RecipeError&) {
  }
  return 0;
}
