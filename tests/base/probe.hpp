#pragma once
// Running a probe: a small program started afresh for each setting a test tries, because the
// setting (an environment variable) is read once when a library loads.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace fsdpp::test {

// What `cmd` writes to its standard output; requires that it ran and exited with status 0.
inline std::string probe_output(const std::string& cmd) {
  FILE* f = popen(cmd.c_str(), "r");
  REQUIRE(f);
  std::string out;
  char buf[1024];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
  const int status = pclose(f);
  INFO(cmd);
  INFO(out);
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  return out;
}

}  // namespace fsdpp::test
