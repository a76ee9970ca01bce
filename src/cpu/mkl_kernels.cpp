// libfsdpp_mkl_kernels.so: MKL's kernels by instruction set on other vendors' CPUs, for the programs
// that ask for them (Note [MKL's kernels on other vendors' CPUs], include/fsdpp/base/mkl_dispatch.hpp).
// The fsdpp command line links it ahead of LibTorch; any program can preload it
// (LD_PRELOAD=libfsdpp_mkl_kernels.so), as the benchmarks do for PyTorch. libfsdpp.so itself
// defines nothing of MKL's.
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

struct Decision {
  bool by_instruction_set = false;
  std::string detail;
};

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

Decision decide() {
  // MKL may ask while LibTorch's static objects are constructed, before libgcc's CPU model is.
  __builtin_cpu_init();
  // No exception can leave here (MKL's C code calls in), so a value that is neither 0 nor 1 keeps
  // MKL's own choice, and the detail names it.
  if (const char* v = std::getenv("FSDPP_MKL_VENDOR_CHECK"); v && *v && std::strcmp(v, "0") != 0) {
    if (std::strcmp(v, "1") == 0)
      return {__builtin_cpu_is("intel") != 0, "MKL's own choice of kernels (FSDPP_MKL_VENDOR_CHECK=1)"};
    return {
        __builtin_cpu_is("intel") != 0,
        std::string("MKL's own choice of kernels (FSDPP_MKL_VENDOR_CHECK='") + v + "' is neither 0 nor 1)"};
  }
  if (__builtin_cpu_is("intel"))
    return {true, "MKL's own choice of kernels, by instruction set (an Intel CPU)"};
  if (!has_avx512()) return {false, "MKL's own choice of kernels (no AVX-512 on this CPU)"};
  return {true,
          "MKL's kernels chosen by instruction set, AVX-512 on this CPU, as libfsdpp_mkl_kernels.so asks "
          "(FSDPP_MKL_VENDOR_CHECK=1 keeps MKL's own choice)"};
}

const Decision& decision() {
  static const Decision d = decide();  // function-local: MKL may ask before static objects exist
  return d;
}

}  // namespace

// MKL asks this before choosing its kernels; libtorch_cpu.so calls it through its PLT, so the
// first definition the program finds answers.
extern "C" __attribute__((visibility("default"))) int mkl_serv_intel_cpu_true() {
  return decision().by_instruction_set ? 1 : 0;
}

// For fsdpp::mkl_dispatch(): what this library decided.
extern "C" __attribute__((visibility("default"))) int fsdpp_mkl_kernels_by_instruction_set() {
  return decision().by_instruction_set ? 1 : 0;
}
extern "C" __attribute__((visibility("default"))) const char* fsdpp_mkl_kernels_detail() {
  return decision().detail.c_str();
}
