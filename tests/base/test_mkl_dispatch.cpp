// Note [MKL's kernels on other vendors' CPUs] (fsdpp/base/mkl_dispatch.hpp), in fresh processes
// (tests/train/mkl_probe.cpp): on a CPU with AVX-512 not made by Intel, MKL picks its kernels by
// instruction set, newer than the ones it picks by itself there, and FSDPP_MKL_VENDOR_CHECK=1
// leaves its own choice; elsewhere both are MKL's own.
#include <doctest/doctest.h>

#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "train/probe.hpp"

namespace {

struct Probe {
  std::string out;
  int field(const std::string& name) const {
    const auto at = out.find(name + "=");
    REQUIRE(at != std::string::npos);
    return std::stoi(out.substr(at + name.size() + 1));
  }
};

Probe probe(const std::string& env) {
  return {fsdpp::test::probe_output("env -u FSDPP_MKL_VENDOR_CHECK " + env + " " + FSDPP_MKL_PROBE_BIN + " 2>&1")};
}

bool avx512_not_intel() {
  __builtin_cpu_init();
  return !__builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

}  // namespace

TEST_CASE("mkl dispatch: MKL picks its kernels by instruction set on other vendors' AVX-512 CPUs, unless told not to") {
  const auto chosen = probe(""), own = probe("FSDPP_MKL_VENDOR_CHECK=1");
  INFO(chosen.out);
  INFO(own.out);
  CHECK(chosen.field("finite") == 1);
  CHECK(own.field("finite") == 1);
  if (chosen.field("detect") < 0) {
    MESSAGE("this LibTorch has no MKL: " << chosen.out);
    CHECK(chosen.out.find("no MKL in this LibTorch") != std::string::npos);
    return;
  }
  if (avx512_not_intel()) {
    CHECK(chosen.field("by_instruction_set") == 1);
    CHECK(own.field("by_instruction_set") == 0);
    CHECK(chosen.field("detect") > own.field("detect"));
    CHECK(own.out.find("FSDPP_MKL_VENDOR_CHECK=1") != std::string::npos);
  } else {
    MESSAGE("an Intel CPU or one without AVX-512: MKL's own choice both ways");
    CHECK(chosen.field("detect") == own.field("detect"));
  }
  // 0 is the default; another value keeps MKL's own choice, named in the detail.
  const auto zero = probe("FSDPP_MKL_VENDOR_CHECK=0"), bad = probe("FSDPP_MKL_VENDOR_CHECK=maybe");
  INFO(zero.out);
  INFO(bad.out);
  CHECK(zero.field("detect") == chosen.field("detect"));
  CHECK(bad.field("detect") == own.field("detect"));
  CHECK(bad.out.find("FSDPP_MKL_VENDOR_CHECK='maybe' is neither 0 nor 1") != std::string::npos);
}

// Note [MKL vector math's first calls]: resolve_mkl_vml_kernels reaches every vector-math function
// ATen's header declares it sends float and double operators to, as counted by a process that
// defines them ahead of MKL (tests/train/vml_probe.cpp). A function that a later LibTorch adds to
// the header and the warm-up lacks shows here as one the probe does not count.
TEST_CASE("mkl vector math: resolve_mkl_vml_kernels calls each function ATen sends float and double unary operators to") {
  if (probe("").field("detect") < 0) {
    MESSAGE("this LibTorch has no MKL: ATen computes these operators itself");
    return;
  }
  // IMPLEMENT_VML_MKL(cos, Cos): ATen's cos goes to vmsCos (float) and vmdCos (double); lines
  // commented out with // are not matched (the regex wants the macro at a line's start).
  std::vector<std::string> declared;
  std::ifstream header(FSDPP_ATEN_VML_H);
  REQUIRE(header);
  const std::regex line(R"(^\s*IMPLEMENT_VML_MKL\(\s*\w+\s*,\s*(\w+)\s*\))");
  for (std::string l; std::getline(header, l);)
    if (std::smatch m; std::regex_search(l, m, line)) declared.push_back(m[1]);
  INFO("ATen/cpu/vml.h: " << FSDPP_ATEN_VML_H);
  REQUIRE(declared.size() >= 10);
  const auto out = fsdpp::test::probe_output(std::string(FSDPP_VML_PROBE_BIN) + " 2>&1");
  INFO(out);
  for (const auto& op : declared)
    for (const char* prefix : {"vms", "vmd"}) {
      const std::string name = prefix + op;
      CAPTURE(name);
      const auto at = out.find(name + "=");
      REQUIRE_MESSAGE(at != std::string::npos, "ATen sends operators to " << name
                                                << ", which tests/train/vml_probe.cpp does not count: add it there");
      CHECK_MESSAGE(std::stoi(out.substr(at + name.size() + 1)) >= 1,
                    name << " was not called: add its ATen operator to fsdpp::detail::call_mkl_vml_functions");
    }
}
