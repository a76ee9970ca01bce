#pragma once
// What the tests of `fsdpp run` as a user runs it share: shell commands, fresh output directories,
// runs of the tiny recipe, and the metrics they leave.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace fsdpp::test {

// FSDPP_TEST_BIN runs the tests against another build's `fsdpp` (an older one, to see a test fail).
inline const std::string kBin = std::getenv("FSDPP_TEST_BIN") ? std::getenv("FSDPP_TEST_BIN") : FSDPP_BIN;
inline const std::string kRecipe = std::string(FSDPP_SOURCE_DIR) + "/recipes/tiny-synthetic.json";
inline const std::string kPython = FSDPP_PYTHON;  // the Python of the PyTorch fsdpp was built against

struct Result {
  int rc;
  std::string out;
};

inline Result sh(const std::string& cmd) {
  Result r{0, ""};
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

inline std::string fresh_dir(const std::string& name) {
  const auto d =
      std::filesystem::temp_directory_path() / ("fsdpp-run-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove_all(d);
  return d.string();
}

// Runs the tiny recipe into `dir` with extra arguments (and `env`, "NAME=value " assignments, before
// the command); requires success.
inline std::string train_run(const std::string& dir, const std::string& args, const std::string& env = "") {
  const auto r = sh(env + kBin + " run " + kRecipe + " logging.output_dir=" + dir + " " + args);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  return r.out;
}

// One figure of rank 0's metrics, by step.
inline std::map<int64_t, double> metric_by_step(const std::string& dir, const std::string& key) {
  std::map<int64_t, double> out;
  std::ifstream f(std::filesystem::path(dir) / "metrics" / "rank0.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out[j["step"]] = j[key];
  }
  return out;
}

inline std::map<int64_t, double> losses(const std::string& dir) { return metric_by_step(dir, "loss"); }

}  // namespace fsdpp::test
