// Note [MKL's kernels on other vendors' CPUs] (fsdpp/base/mkl_dispatch.hpp), in fresh processes
// (tests/train/mkl_probe.cpp): on a CPU with AVX-512 not made by Intel, MKL picks its kernels by
// instruction set, newer than the ones it picks by itself there, and FSDPP_MKL_VENDOR_CHECK=1
// leaves its own choice; elsewhere both are MKL's own.
#include <doctest/doctest.h>

#include <string>

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
