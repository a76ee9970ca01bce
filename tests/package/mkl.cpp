// Links fsdpp::mkl_kernels ahead of LibTorch, as a program that asks for MKL's kernels by
// instruction set does; prints what MKL was told for the test to check.
#include <fsdpp/base/mkl_dispatch.hpp>

#include <iostream>

int main() {
  const auto& mkl = fsdpp::mkl_dispatch();
  std::cout << "consumer MKL: asked=" << mkl.asked << " " << mkl.detail << std::endl;
}
