// A fresh process for tests/base/test_mkl_dispatch.cpp: a program that links libfsdpp.so computes
// one float32 product through ATen (MKL, in PyTorch's x86 wheels) on one thread, writes its bytes to
// the file named by its argument, and reports what fsdpp::mkl_dispatch() says MKL does and the
// kernel family MKL chose, as MKL itself reports it (mkl_serv_cpu_detect: 0 for its generic x86-64
// kernels, higher for newer instruction sets; -1 where this LibTorch has no MKL).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <fstream>

#include "fsdpp/base/mkl_dispatch.hpp"

extern "C" [[gnu::weak]] int mkl_serv_cpu_detect();

int main(int argc, char** argv) {
  at::set_num_threads(1);
  // Inputs any process can make alike: ((37 i mod 101) - 50) / 7 in row-major order.
  const auto i = at::arange(384 * 384, at::kDouble);
  const auto a = ((i * 37).remainder(101) - 50).div(7).to(at::kFloat).reshape({384, 384});
  const auto c = at::mm(a, a).contiguous();
  if (argc > 1)
    std::ofstream(argv[1], std::ios::binary).write(static_cast<const char*>(c.data_ptr()), c.numel() * 4);
  const int detect = &mkl_serv_cpu_detect ? mkl_serv_cpu_detect() : -1;
  const auto& d = fsdpp::mkl_dispatch();
  std::printf("by_instruction_set=%d asked=%d detect=%d finite=%d detail=%s\n", d.by_instruction_set ? 1 : 0,
              d.asked ? 1 : 0, detect, at::isfinite(c).all().item<bool>() ? 1 : 0, d.detail.c_str());
  return 0;
}
