#pragma once
// The model's bfloat16 matrix products on the CPU by MKL's bfloat16 kernel, called directly; every
// other product is ATen's own (other dtypes, other devices, or with `own` false).
//
// Note [bfloat16 products on the CPU]
// ATen multiplies bfloat16 matrices on the CPU through oneDNN too, and pays for it on every call:
// a primitive described, looked up in (or compiled into) its cache, attributes and scratch memory
// allocated and freed. The experts' row counts change every step, so their products keep
// compiling new kernels. In a bfloat16 training step of moe-small the set-up and the allocator
// took more of the samples than the products themselves (bench/results/bf16_profile.md). MKL's bfloat16 product (cblas_gemm_bf16bf16f32,
// exported by libtorch_cpu.so) takes bfloat16 operands, sums in float32 and writes float32, with
// no set-up and no compilation, as fast as oneDNN's kernels on the CPUs with bfloat16 instructions;
// each result is rounded once to bfloat16 (to nearest even, as ATen converts), so a product is
// the float32 product of the bfloat16 values, rounded, as ATen's is; only the order of each sum
// differs. A row's result depends only on its own operands, not on the rows computed with it
// (tests/models/test_matmul.cpp). MKL's bfloat16 product is a public MKL function, looked up at run
// time in libtorch_cpu.so and tried once on a small product. Where MKL picks its kernels by vendor
// on a non-Intel CPU (Note [MKL's kernels on other vendors' CPUs]), or the CPU has no bfloat16
// instructions, it runs a slower kernel, and bf16_matmul_preferred() keeps the model on ATen's.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace fsdpp::models {

// Whether bfloat16 CPU products can go through MKL's bfloat16 kernel in this process (found and
// checked once).
bool bf16_matmul_available();

// Whether they should: available, the CPU has bfloat16 instructions (AVX512_BF16), and MKL picks
// its kernels by instruction set (Note [bfloat16 products on the CPU]).
bool bf16_matmul_preferred();

// Whether fsdpp's own route beats ATen's for CPU products of this dtype on this machine:
// bf16_matmul_preferred() for bfloat16, no for any other. MoEConfig::own_products asks for the own
// route where this holds.
bool own_products_preferred(at::ScalarType dtype);
// Whether a product of x takes the own route: MoEConfig::own_products allows it (`allowed`), and it
// beats ATen's for x's dtype on this machine.
inline bool own_route(bool allowed, const at::Tensor& x) {
  return allowed && x.is_cpu() && own_products_preferred(x.scalar_type());
}

// x W^T: x [..., in], weight [out, in] -> [..., out]; differentiable in both. With `own`, bfloat16 CPU
// tensors take MKL's bfloat16 kernel where it is available. Otherwise, and for other dtypes and
// devices: at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, bool own);

// One product per group of rows: x [rows, in] sorted by group, weight [groups, out, in], `ends`
// (int32 or int64 [groups] on the host, non-decreasing, the last at most rows) the cumulative row
// counts, group g taking rows [ends[g-1], ends[g]). Row r of the result is x[r] W_g^T; rows past
// the last end are zero, and so is x's gradient there. Differentiable in x and weight. With `own`,
// bfloat16 CPU tensors take the same route as linear's; otherwise
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
