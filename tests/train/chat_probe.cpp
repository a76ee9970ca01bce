// What tests/train/test_chat_template.py compares with transformers' apply_chat_template: reads a
// JSON file {"template": ..., "cases": [variables...]} and prints a JSON list with, per case,
// {"text": rendered, "generated": [[begin, end]...]} or {"error": message}; a template that does not
// parse prints {"parse_error": message} and exits 2.
//   fsdpp_chat_probe CASES.json
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "../../src/train/text/chat_template.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fsdpp_chat_probe CASES.json\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  const auto input = nlohmann::ordered_json::parse(in);
  std::unique_ptr<fsdpp::train::text::ChatTemplate> t;
  try {
    t = std::make_unique<fsdpp::train::text::ChatTemplate>(input.at("template").get<std::string>());
  } catch (const std::exception& e) {
    std::cout << nlohmann::json{{"parse_error", e.what()}}.dump() << "\n";
    return 2;
  }
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& c : input.at("cases")) {
    std::vector<std::pair<size_t, size_t>> generated;
    try {
      const auto text = t->render(c, &generated);
      out.push_back({{"text", text}, {"generated", generated}});
    } catch (const std::exception& e) {
      out.push_back({{"error", e.what()}});
    }
  }
  std::cout << out.dump() << "\n";
  return 0;
}
