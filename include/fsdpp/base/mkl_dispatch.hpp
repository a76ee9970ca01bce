#pragma once
// Note [MKL's kernels on other vendors' CPUs]
// PyTorch's x86 wheels carry MKL inside libtorch_cpu.so, and ATen's float32 products on the CPU
// (at::mm, at::linear, at::_grouped_mm, and the blocks of the CPU flash attention) run on it. MKL
// chooses its kernels by vendor before instruction set: it asks `mkl_serv_intel_cpu_true()`, and
// on any CPU not made by Intel it stays on its AVX2 kernels even where the CPU has AVX-512, at
// about half the speed (bench/results/matmul.md). libtorch_cpu.so calls that function through its
// PLT, and libfsdpp.so, loaded ahead of it, defines it: on a CPU with AVX-512 (F, BW, DQ and VL,
// enabled by the OS) the answer is yes, and MKL then picks its kernels by the instruction sets the
// CPU reports, as it does on Intel's. Everywhere else the answer is MKL's own.
//
// FSDPP_MKL_VENDOR_CHECK=1 in the environment keeps MKL's own answer, which gives bit for bit the
// products of a PyTorch process on the same machine (the parity tests against PyTorch set it); 0 or
// unset answers as above; any other value keeps MKL's own answer too, and the detail names it. MKL
// asks once, at its first product, so the setting holds for the whole process.

#include <string>

namespace fsdpp {

struct MklDispatch {
  bool by_instruction_set = false;  // MKL told the CPU is Intel's: kernels by instruction set
  std::string detail;               // what was decided and why, for the log
};

// The decision (made once, at MKL's first question or here, whichever comes first).
const MklDispatch& mkl_dispatch();

}  // namespace fsdpp
