#include "fsdpp/base/mkl_dispatch.hpp"

#include <dlfcn.h>

namespace fsdpp {

const MklDispatch& mkl_dispatch() {
  static const MklDispatch decision = [] {
    __builtin_cpu_init();
    // libfsdpp_mkl_kernels.so, where the program linked or preloaded it, says what it told MKL.
    using Flag = int (*)();
    using Detail = const char* (*)();
    const auto flag = reinterpret_cast<Flag>(dlsym(RTLD_DEFAULT, "fsdpp_mkl_kernels_by_instruction_set"));
    const auto detail = reinterpret_cast<Detail>(dlsym(RTLD_DEFAULT, "fsdpp_mkl_kernels_detail"));
    if (flag && detail) return MklDispatch{flag() != 0, true, detail()};
    // Otherwise MKL decides alone: by instruction set on Intel's CPUs, by vendor elsewhere.
    const bool intel = __builtin_cpu_is("intel");
    return MklDispatch{
        intel, false,
        intel ? "MKL's own choice of kernels, by instruction set (an Intel CPU)"
              : "MKL's own choice of kernels (this program does not link libfsdpp_mkl_kernels.so)"};
  }();
  return decision;
}

}  // namespace fsdpp
