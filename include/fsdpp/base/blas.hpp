#pragma once
// Which BLAS library LibTorch multiplies with, and how fast: a separate libblas/OpenBLAS/MKL that the
// process loaded, or the one built into libtorch_cpu.so (MKL in PyTorch's x86 wheels). Programs
// print this at start-up to make a slow setup visible at once.

#include <string>

namespace fsdpp {

struct BlasInfo {
  std::string library;       // resolved path of the loaded BLAS, or "inside libtorch_cpu.so"
  std::string kind;          // "OpenBLAS (pthread)", "reference BLAS", "mkl", ...
  double matmul_gflops = 0;  // float32 1024x1024 matmul on this process's threads
};

BlasInfo probe_blas(bool measure = true);

// "BLAS: OpenBLAS (pthread) [/usr/lib/...], float32 1024^2 matmul 212.4 GFLOP/s"
std::string describe(const BlasInfo& info);

}  // namespace fsdpp
