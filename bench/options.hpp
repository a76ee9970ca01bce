#pragma once
// The benches' integer options, given as `--name value` pairs.
#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

namespace fsdpp::bench {

// Sets *options.at(name) from each `--name value` pair of argv. False, having said on stderr what is
// wrong, for a name not in `options`, a name without a value, or a value that is not an integer.
inline bool parse_options(int argc, char** argv, const char* program,
                          const std::map<std::string, int64_t*>& options) {
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    const auto it = a.rfind("--", 0) == 0 ? options.find(a.substr(2)) : options.end();
    if (it == options.end()) {
      fmt::print(stderr, "{}: unknown option {}\n", program, a);
      return false;
    }
    if (i + 1 >= argc) {
      fmt::print(stderr, "{}: {} needs a value\n", program, a);
      return false;
    }
    char* end = nullptr;
    const long long v = std::strtoll(argv[i + 1], &end, 10);
    if (end == argv[i + 1] || *end != '\0') {
      fmt::print(stderr, "{}: {} takes an integer, got '{}'\n", program, a, argv[i + 1]);
      return false;
    }
    *it->second = v;
  }
  return true;
}

}  // namespace fsdpp::bench
