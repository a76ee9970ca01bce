#include "fsdpp/base/mkl_dispatch.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace fsdpp {

namespace {

using Answer = int (*)();

bool in_this_library(void* p) {
  static int marker;
  Dl_info found{}, here{};
  return dladdr(p, &found) != 0 && dladdr(&marker, &here) != 0 && found.dli_fbase == here.dli_fbase;
}

// MKL's own question, libtorch_cpu.so's definition: the next after this library's, or the first
// where this library's comes later; null where this LibTorch has no MKL.
Answer mkl_own() {
  static const auto own = [] {
    void* p = dlsym(RTLD_NEXT, "mkl_serv_intel_cpu_true");
    if (!p) p = dlsym(RTLD_DEFAULT, "mkl_serv_intel_cpu_true");
    return p && !in_this_library(p) ? reinterpret_cast<Answer>(p) : nullptr;
  }();
  return own;
}

int mkl_own_answer() { return mkl_own() ? mkl_own()() : 0; }

// Whether MKL's calls reach this library's definition: the first the program finds.
bool asked_here() {
  void* const first = dlsym(RTLD_DEFAULT, "mkl_serv_intel_cpu_true");
  return first && in_this_library(first);
}

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

MklDispatch decide() {
  // MKL may ask while LibTorch's static objects are constructed, before libgcc's CPU model is.
  __builtin_cpu_init();
  if (!mkl_own()) return {false, "no MKL in this LibTorch"};
  if (!asked_here())
    return {mkl_own_answer() != 0, "MKL's own choice of kernels (this program finds libtorch_cpu.so's "
                                   "mkl_serv_intel_cpu_true before libfsdpp.so's: link fsdpp first)"};
  // No exception can leave here (MKL's C code calls in), so a value that is neither 0 nor 1 keeps
  // MKL's own choice, and the detail names it.
  if (const char* v = std::getenv("FSDPP_MKL_VENDOR_CHECK"); v && *v && std::strcmp(v, "0") != 0) {
    if (std::strcmp(v, "1") == 0) return {mkl_own_answer() != 0, "MKL's own choice of kernels (FSDPP_MKL_VENDOR_CHECK=1)"};
    return {mkl_own_answer() != 0, std::string("MKL's own choice of kernels (FSDPP_MKL_VENDOR_CHECK='") + v +
                                       "' is neither 0 nor 1)"};
  }
  if (__builtin_cpu_is("intel")) return {mkl_own_answer() != 0, "MKL's own choice of kernels (an Intel CPU)"};
  if (!has_avx512()) return {mkl_own_answer() != 0, "MKL's own choice of kernels (no AVX-512 on this CPU)"};
  return {true, "MKL's kernels chosen by instruction set, AVX-512 on this CPU (FSDPP_MKL_VENDOR_CHECK=1 keeps MKL's own choice)"};
}

}  // namespace

const MklDispatch& mkl_dispatch() {
  // Function-local: MKL may ask before this library's static objects are constructed.
  static const MklDispatch decision = decide();
  return decision;
}

}  // namespace fsdpp

// Note [MKL's kernels on other vendors' CPUs]: the function MKL asks, found here before its own.
extern "C" __attribute__((visibility("default"))) int mkl_serv_intel_cpu_true() {
  return fsdpp::mkl_dispatch().by_instruction_set ? 1 : 0;
}
