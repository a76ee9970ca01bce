#pragma once
// The model's matrix products on the CPU by routes of fsdpp's own: float32 by the oneDNN that
// LibTorch carries, bfloat16 by its MKL's bfloat16 kernel called directly.
//
// ATen multiplies float32 matrices on the CPU with its BLAS (MKL in PyTorch's wheels). MKL picks
// its kernels by vendor: on AMD processors it runs its AVX2 kernels even where the CPU has full
// AVX-512, and stays near the AVX2 peak (about 100 GFLOP/s a core on an EPYC of family 26).
// oneDNN picks by instruction set and runs AVX-512 kernels there, about twice as fast on the
// model's shapes (bench/results/matmul.md). These functions compute x W^T, and its gradients,
// through oneDNN for float32 CPU tensors, and are ATen's own operations everywhere else (other
// dtypes, other devices, or with `onednn` false), so a GPU or a bfloat16 model runs exactly as
// before. libfsdpp.so also tells MKL to pick its kernels by instruction set (Note [MKL's kernels on
// other vendors' CPUs], fsdpp/base/mkl_dispatch.hpp); ATen's products are then as fast or faster,
// and the model uses these only where MKL stays on slower kernels (onednn_matmul_preferred()).
//
// oneDNN sums in another order than MKL, so the results are not MKL's bits (float32 rounding
// apart: tests/train/test_matmul.cpp bounds it); MoEConfig::onednn_matmul = false gives ATen's,
// bit for bit what PyTorch's eager modules compute. A row of a product does not depend on the
// other rows computed with it (the same test checks it for the experts' groups), so expert
// parallelism, which groups rows differently, gives the same outputs.
//
// oneDNN's matrix product is reached through ATen's `at::native::mkldnn_matmul`, which LibTorch
// exports but does not declare in its installed headers. It is looked up at run time and tried
// once on a small product; where it is missing, refuses float32 (a CPU without AVX-512, whose
// oneDNN would run AVX2 kernels anyway), or gives a wrong result, ATen's product is used and
// onednn_matmul_available() says so.
//
// Note [bfloat16 products on the CPU]
// ATen multiplies bfloat16 matrices on the CPU through oneDNN too, and pays for it on every call:
// a primitive described, looked up in (or compiled into) its cache, attributes and scratch memory
// allocated and freed. The experts' row counts change every step, so their products keep
// compiling new kernels. In a bfloat16 training step of moe-small the set-up took 22% of the
// samples and the allocator 26%, against 32% for the products themselves
// (bench/results/bf16_profile.md). MKL's bfloat16 product (cblas_gemm_bf16bf16f32,
// exported by libtorch_cpu.so) takes bfloat16 operands, sums in float32 and writes float32, with
// no set-up and no compilation, as fast as oneDNN's kernels on the CPUs with bfloat16 instructions;
// each result is rounded once to bfloat16 (to nearest even, as ATen converts), so a product is
// the float32 product of the bfloat16 values, rounded, as ATen's is; only the order of each sum
// differs. A row's result depends only on its own operands, not on the rows computed with it
// (tests/train/test_matmul.cpp). Where MKL picks its kernels by vendor on a non-Intel CPU (Note
// [MKL's kernels on other vendors' CPUs]), or the CPU has no bfloat16 instructions, it runs a
// slower kernel, and bf16_matmul_preferred() keeps the model on ATen's.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace fsdpp::models {

// Whether float32 CPU products can go through oneDNN in this process (found and checked once).
bool onednn_matmul_available();

// Whether they should: oneDNN is available and ATen's BLAS is not on kernels as fast already. MKL
// picks its AVX-512 kernels on an Intel CPU, and on other vendors' CPUs once told to
// (Note [MKL's kernels on other vendors' CPUs], fsdpp/base/mkl_dispatch.hpp); it then beats oneDNN
// on the model's step, having no per-call set-up to speak of and no kernel to compile per row count
// (bench/results/matmul.md). The model goes through oneDNN only where this holds:
// MoEConfig::onednn_matmul asks for oneDNN where it is faster.
bool onednn_matmul_preferred();

// Whether bfloat16 CPU products can go through MKL's bfloat16 kernel in this process (found and
// checked once).
bool bf16_matmul_available();

// Whether they should: available, the CPU has bfloat16 instructions (AVX512_BF16), and MKL picks
// its kernels by instruction set (Note [bfloat16 products on the CPU]).
bool bf16_matmul_preferred();

// Whether fsdpp's own route beats ATen's for CPU products of this dtype on this machine:
// onednn_matmul_preferred() for float32, bf16_matmul_preferred() for bfloat16, no for any other.
// MoEConfig::onednn_matmul asks for the own routes where this holds.
bool own_products_preferred(at::ScalarType dtype);

// x W^T: x [..., in], weight [out, in] -> [..., out]; differentiable in both. With `own`, CPU
// tensors take fsdpp's own route for their dtype where it is available: float32 oneDNN's product,
// bfloat16 MKL's bfloat16 kernel. Otherwise, and for other dtypes and devices: at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, bool own);

// One product per group of rows: x [rows, in] sorted by group, weight [groups, out, in], `ends`
// (int32 or int64 [groups] on the host, non-decreasing, the last at most rows) the cumulative row
// counts, group g taking rows [ends[g-1], ends[g]). Row r of the result is x[r] W_g^T; rows past
// the last end are zero, and so is x's gradient there. Differentiable in x and weight. With `own`,
// float32 and bfloat16 CPU tensors take the same routes as linear's; otherwise
// at::_grouped_mm(x, weight^T, ends), on the rows up to the last end where `ends` are on the host
// (ATen's leaves the others unwritten, forward and backward; with `ends` on a GPU every row goes
// to it), and one at::mm per group on the CPU where x's or the result's rows are not a multiple of
// 16 bytes long, which at::_grouped_mm refuses.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends, bool own);

namespace detail {
// grouped_linear's `ends` checked against `rows` rows of x and `groups` groups and read on the host;
// c10::Error naming `what` and what is wrong otherwise.
std::vector<int64_t> group_ends(const at::Tensor& ends, int64_t rows, int64_t groups, const char* what);
}  // namespace detail

}  // namespace fsdpp::models
