// A fresh process for tests/base/test_mkl_dispatch.cpp: which of MKL's vector-math functions
// libtorch_cpu.so calls while fsdpp::resolve_mkl_vml_kernels() runs (Note [MKL vector math's first
// calls]). libtorch_cpu.so calls them through its PLT, so the definitions here, in the executable,
// come first; each counts its call and passes it on to MKL's. Prints "name=count" for each, on one
// line; with the argument "none" it calls nothing first (every count stays 0).
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "fsdpp/base/mkl_vml.hpp"

namespace {

struct Counted {
  const char* name;
  int calls;
};

// MKL's signature: (MKL_INT n, const T* a, T* r, MKL_INT64 mode). n is passed on as the whole
// register it arrived in, whether MKL_INT is 32 or 64 bits wide.
template <typename T>
void forward(Counted& c, intptr_t n, const T* a, T* r, int64_t mode) {
  using Fn = void (*)(intptr_t, const T*, T*, int64_t);
  ++c.calls;
  if (const auto real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, c.name))) real(n, a, r, mode);
}

}  // namespace

// ATen/cpu/vml.h's IMPLEMENT_VML_MKL list, in float (vms) and double (vmd).
// clang-format off
#define FSDPP_VML_FUNCTIONS(X) \
  X(Acos) X(Asin) X(Atan) X(Cos) X(Erf) X(Erfc) X(ErfInv) X(Exp) X(Ln) X(Log10) X(Log2) X(Sin) \
  X(Sqrt) X(Tan) X(Tanh) X(Trunc)
// clang-format on

#define FSDPP_COUNTERS(op) Counted count_vms##op{"vms" #op, 0}, count_vmd##op{"vmd" #op, 0};
FSDPP_VML_FUNCTIONS(FSDPP_COUNTERS)

#define FSDPP_DEFINE(op)                                                                                 \
  extern "C" __attribute__((visibility("default"))) void vms##op(intptr_t n, const float* a, float* r,   \
                                                                 int64_t mode) {                         \
    forward(count_vms##op, n, a, r, mode);                                                               \
  }                                                                                                      \
  extern "C" __attribute__((visibility("default"))) void vmd##op(intptr_t n, const double* a, double* r, \
                                                                 int64_t mode) {                         \
    forward(count_vmd##op, n, a, r, mode);                                                               \
  }
FSDPP_VML_FUNCTIONS(FSDPP_DEFINE)

int main(int argc, char** argv) {
  if (!(argc > 1 && std::strcmp(argv[1], "none") == 0)) fsdpp::resolve_mkl_vml_kernels();
#define FSDPP_PRINT(op) std::printf("vms%s=%d vmd%s=%d ", #op, count_vms##op.calls, #op, count_vmd##op.calls);
  FSDPP_VML_FUNCTIONS(FSDPP_PRINT)
  std::printf("\n");
  return 0;
}
