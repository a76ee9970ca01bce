#pragma once
// Note [MKL's kernels on other vendors' CPUs]
// PyTorch's x86 wheels carry MKL inside libtorch_cpu.so, and ATen's float32 products on the CPU
// (at::mm, at::linear, at::_grouped_mm, and the blocks of the CPU flash attention) run on it. MKL
// chooses its kernels by vendor before instruction set: it asks `mkl_serv_intel_cpu_true()`, and
// on any CPU not made by Intel it stays on its AVX2 kernels even where the CPU has AVX-512,
// markedly slower (bench/results/matmul.md). libtorch_cpu.so calls that function through its
// PLT, so the first definition the program finds answers.
//
// libfsdpp.so defines nothing of MKL's: a program that links it gets MKL's own choice, bit for bit a
// plain LibTorch program's products (tests/base/test_mkl_dispatch.cpp). A program that wants MKL's
// kernels by instruction set links libfsdpp_mkl_kernels.so ahead of LibTorch, or preloads it; its
// answer is yes on a CPU with AVX-512 (F, BW, DQ and VL, enabled by the OS), MKL's own elsewhere.
// The fsdpp command line links it and logs the decision (`MKL: ...`); FSDPP_MKL_VENDOR_CHECK=1 in
// the environment makes it keep MKL's own answer. MKL asks once, at its first product, so the
// answer holds for the whole process.

#include <string>

namespace fsdpp {

struct MklDispatch {
  bool by_instruction_set = false;  // MKL picks its kernels by instruction set in this process
  bool asked = false;               // the program links or preloads libfsdpp_mkl_kernels.so
  std::string detail;               // what was decided and why, for the log
};

// What MKL does in this process: as libfsdpp_mkl_kernels.so decided where the program links or
// preloads it, MKL's own choice otherwise.
const MklDispatch& mkl_dispatch();

}  // namespace fsdpp
