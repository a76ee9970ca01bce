#include "blas_gemm.hpp"

#include <ATen/ATen.h>

#include <dlfcn.h>

namespace fsdpp::models::detail {

namespace {

// A symbol of the library that holds ATen (LibTorch's own BLAS lives there, the one ATen's products
// use), or null.
template <class F>
F torch_symbol(const char* name) {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&at::_ops::empty_memory_format::call), &info) || !info.dli_fname)
    return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return nullptr;
  auto f = reinterpret_cast<F>(dlsym(lib, name));
  dlclose(lib);  // the reference RTLD_NOLOAD took; the library stays loaded
  return f;
}

// The Fortran BLAS's sgemm_ (null where LibTorch has none).
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*, const int*);

Sgemm blas_sgemm() {
  static const auto f = torch_symbol<Sgemm>("sgemm_");
  return f;
}

// MKL's bfloat16 product, C interface (row-major layout 101, no transpose 111, transpose 112; LP64
// integers, as PyTorch's MKL is linked).
using GemmBf16 = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int,
                          float, float*, int);

GemmBf16 blas_gemm_bf16() {
  static const auto f = torch_symbol<GemmBf16>("cblas_gemm_bf16bf16f32");
  return f;
}

// MKL's Fortran entry takes its argument by address and returns the thread's setting before (0:
// the process's); null without MKL.
using SetLocalThreads = int (*)(const int*);
SetLocalThreads set_local_threads() {
  static const auto f = torch_symbol<SetLocalThreads>("mkl_set_num_threads_local_");
  return f;
}

}  // namespace

bool blas_available() { return blas_sgemm() != nullptr; }

// A row-major matrix is its transpose in the BLAS's column-major terms, so this is
// C^T = op(B)^T op(A)^T there.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int M = int(n), N = int(m), K = int(k), la = int(ldb), lb = int(lda), lc = int(ldc);
  blas_sgemm()(&ta, &tb, &M, &N, &K, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

bool blas_bf16_available() { return blas_gemm_bf16() != nullptr; }

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
               int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  blas_gemm_bf16()(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, int(m), int(n),
                   int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

BlasOnThisThread::BlasOnThisThread() {
  const int one = 1;
  if (set_local_threads()) before_ = set_local_threads()(&one);
}

BlasOnThisThread::~BlasOnThisThread() {
  if (set_local_threads()) set_local_threads()(&before_);
}

}  // namespace fsdpp::models::detail
