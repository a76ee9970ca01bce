#pragma once
// LibTorch's own BLAS (the one ATen's products use: MKL in PyTorch's x86 wheels), called directly
// by the model's CPU kernels that run their products on a block or a chunk of rows at a time
// (attention.cpp, kernels.cpp): a product per call without ATen's dispatch around it.
#include <cstdint>

namespace fsdpp::models::detail {

// Whether LibTorch has a Fortran sgemm_ in this process.
bool blas_available();

// Row-major C[m, n] = alpha op(A) op(B) + beta C, op(X) = X^T where asked; each matrix row-major
// with its leading dimension. Needs blas_available().
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Whether LibTorch's MKL has its bfloat16 product (cblas_gemm_bf16bf16f32) in this process.
bool blas_bf16_available();

// Row-major C[m, n] = alpha op(A) op(B) + beta C with A and B bfloat16 (their bits) and C float32:
// every product and sum in float32. Needs blas_bf16_available().
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
               int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);

// While it lives, the calling thread's BLAS products run on that thread alone. MKL otherwise
// splits a product by the OpenMP thread count it sees, and on its AVX2 kernels some splits round
// otherwise than one thread: a kernel's bits would depend on ATen's thread count.
class BlasOnThisThread {
 public:
  BlasOnThisThread();
  ~BlasOnThisThread();
  BlasOnThisThread(const BlasOnThisThread&) = delete;
  BlasOnThisThread& operator=(const BlasOnThisThread&) = delete;

 private:
  int before_ = 0;
};

}  // namespace fsdpp::models::detail
