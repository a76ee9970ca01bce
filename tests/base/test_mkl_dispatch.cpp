// Note [MKL's kernels on other vendors' CPUs] (fsdpp/base/mkl_dispatch.hpp), in fresh processes
// (tests/base/mkl_probe.cpp, which links libfsdpp.so and calls nothing of it but to report): such a
// program runs MKL's own kernels, its products bit for bit those of a plain PyTorch process on the
// same inputs; preloading libfsdpp_mkl_kernels.so makes MKL pick its kernels by instruction set on
// another vendor's AVX-512 CPU (newer kernels, other bits), and FSDPP_MKL_VENDOR_CHECK=1 undoes it.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <unistd.h>
#include <vector>

#include "base/probe.hpp"

namespace {

struct Probe {
  std::string out, product;  // the report, and the product's bytes
  int field(const std::string& name) const {
    const auto at = out.find(name + "=");
    REQUIRE(at != std::string::npos);
    return std::stoi(out.substr(at + name.size() + 1));
  }
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

Probe probe(const std::string& env) {
  const auto file =
      (std::filesystem::temp_directory_path() / ("fsdpp-mkl-probe-" + std::to_string(getpid()))).string();
  Probe p{fsdpp::test::probe_output("env -u FSDPP_MKL_VENDOR_CHECK -u LD_PRELOAD " + env + " " +
                                    FSDPP_MKL_PROBE_BIN + " " + file + " 2>&1"),
          ""};
  p.product = read_bytes(file);
  std::filesystem::remove(file);
  return p;
}

bool avx512_not_intel() {
  __builtin_cpu_init();
  return !__builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

// The same product by PyTorch in a process of its own (mkl_probe.cpp makes the same inputs).
std::string pytorch_product() {
  const auto file =
      (std::filesystem::temp_directory_path() / ("fsdpp-mkl-torch-" + std::to_string(getpid()))).string();
  fsdpp::test::probe_output(std::string("env -u LD_PRELOAD ") + FSDPP_PYTHON +
                            " -c '"
                            "import sys, torch; torch.set_num_threads(1); "
                            "i = torch.arange(384 * 384, dtype=torch.float64); "
                            "a = (((i * 37) % 101 - 50) / 7).float().reshape(384, 384); "
                            "open(sys.argv[1], \"wb\").write(torch.mm(a, a).numpy().tobytes())' " +
                            file + " 2>&1");
  auto bytes = read_bytes(file);
  std::filesystem::remove(file);
  return bytes;
}

}  // namespace

TEST_CASE(
    "mkl dispatch: a program that links fsdpp runs MKL's own kernels, bit for bit PyTorch's products; "
    "libfsdpp_mkl_kernels.so asks for kernels by instruction set") {
  const auto own = probe("");
  const std::string preload = std::string("LD_PRELOAD=") + FSDPP_MKL_KERNELS_LIB;
  const auto asked = probe(preload), undone = probe(preload + " FSDPP_MKL_VENDOR_CHECK=1");
  INFO(own.out);
  INFO(asked.out);
  CHECK(own.field("finite") == 1);
  CHECK(asked.field("finite") == 1);
  if (own.field("detect") < 0) {
    MESSAGE("this LibTorch has no MKL: " << own.out);
    return;
  }
  // Linking fsdpp changes nothing: the same bits as a plain PyTorch process.
  REQUIRE(own.product.size() == 384 * 384 * 4);
  CHECK(own.product == pytorch_product());
  CHECK(own.field("asked") == 0);
  CHECK(asked.field("asked") == 1);
  CHECK(undone.field("detect") == own.field("detect"));
  CHECK(undone.out.find("FSDPP_MKL_VENDOR_CHECK=1") != std::string::npos);
  if (avx512_not_intel()) {
    CHECK(own.field("by_instruction_set") == 0);
    CHECK(asked.field("by_instruction_set") == 1);
    CHECK(asked.field("detect") > own.field("detect"));  // newer kernels
    CHECK(asked.product != own.product);                 // and other bits: the comparison above can fail
  } else {
    MESSAGE("an Intel CPU or one without AVX-512: MKL's own choice both ways");
    CHECK(asked.field("detect") == own.field("detect"));
  }
  const auto bad = probe(preload + " FSDPP_MKL_VENDOR_CHECK=maybe");
  CHECK(bad.field("detect") == own.field("detect"));
  CHECK(bad.out.find("FSDPP_MKL_VENDOR_CHECK='maybe' is neither 0 nor 1") != std::string::npos);
}

// Note [MKL vector math's first calls]: resolve_mkl_vml_kernels reaches every vector-math function
// ATen's header declares it sends float and double operators to, as counted by a process that
// defines them ahead of MKL (tests/base/vml_probe.cpp). A function that a later LibTorch adds to
// the header and the warm-up lacks shows here as one the probe does not count.
TEST_CASE(
    "mkl vector math: resolve_mkl_vml_kernels calls each function ATen sends float and double unary "
    "operators to") {
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
      REQUIRE_MESSAGE(at != std::string::npos,
                      "ATen sends operators to "
                          << name << ", which tests/base/vml_probe.cpp does not count: add it there");
      CHECK_MESSAGE(
          std::stoi(out.substr(at + name.size() + 1)) >= 1,
          name << " was not called: add its ATen operator to fsdpp::detail::call_mkl_vml_functions");
    }
}
