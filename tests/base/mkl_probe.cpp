// A fresh process for tests/train/test_mkl_dispatch.cpp: one float32 product through ATen (MKL,
// in PyTorch's x86 wheels), then what fsdpp decided (Note [MKL's kernels on other vendors' CPUs])
// and the kernel family MKL chose, as MKL itself reports it (mkl_serv_cpu_detect: 0 for its
// generic x86-64 kernels, higher for newer instruction sets; -1 where this LibTorch has no MKL).
#include <ATen/ATen.h>

#include <cstdio>

#include "fsdpp/base/mkl_dispatch.hpp"

extern "C" [[gnu::weak]] int mkl_serv_cpu_detect();

int main() {
  const auto a = at::randn({256, 256});
  const auto c = at::mm(a, a);
  const int detect = &mkl_serv_cpu_detect ? mkl_serv_cpu_detect() : -1;
  const auto& d = fsdpp::mkl_dispatch();
  std::printf("by_instruction_set=%d detect=%d finite=%d detail=%s\n", d.by_instruction_set ? 1 : 0, detect,
              at::isfinite(c).all().item<bool>() ? 1 : 0, d.detail.c_str());
  return 0;
}
