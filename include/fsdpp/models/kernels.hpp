#pragma once
// Single-pass CPU kernels for the model's elementwise work, forward and backward, next to the ATen
// compositions they stand for: RMSNorm, SwiGLU's gate and the rotary embedding of q and k.
//
// For RMSNorm and SwiGLU the compositions take several passes over the activations each way
// (RMSNorm: square, mean, add, rsqrt and two multiplies forward, about twice as many backward, and
// a reduction for the weight's gradient; silu(a) * b: two passes forward, three backward) and keep
// intermediate results for the backward. The kernels read and write each element once per
// direction and keep only their inputs (and one float per row for RMSNorm). These two are not the
// compositions' bits: they sum in another order and take exp from a polynomial (within a few
// float32 ulps of the composition; tests/train/test_model.cpp bounds it), which is why the model
// can switch them off (MoEConfig::fused_kernels) where bitwise agreement with PyTorch's eager
// modules is the point. Each is the composition off the CPU, for float64 (which the composition
// computes as written) and, for swiglu, for anything but float32 (bfloat16's conversions cost more
// than the passes saved). Rows and elements run on ATen's intra-op threads, and the results do not
// depend on how many there are.
//
// The rotary embedding's kernel is the composition's bits (below).
//
// Causal attention's kernel computes what scaled_dot_product_attention(is_causal) computes, in
// fewer and larger matrix products than ATen's CPU flash attention (bench/results/attention.md),
// and is not its bits either (another summation order; exp from the same polynomial).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <utility>

namespace fsdpp::models {

// x * rsqrt(mean(x^2 over the last dimension) + eps) * weight, computed in float32 whatever x's
// dtype (weight: [x.size(-1)]); the result takes x's dtype, the weight's gradient the weight's.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(a) * b = a * sigmoid(a) * b, elementwise (a and b of one shape and dtype): SwiGLU's gate.
at::Tensor swiglu(const at::Tensor& a, const at::Tensor& b);
at::Tensor swiglu_reference(const at::Tensor& a, const at::Tensor& b);

// cos and sin of the rotary angles of T positions, each [T, head_dim] (the head_dim / 2 angles
// position * theta^(-2j / head_dim), repeated twice), computed in float32 and given `options`' dtype.
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t head_dim, double theta, at::TensorOptions options);

// Rotary position embedding of one tensor: x * cos + rotate_half(x) * sin, written as ATen
// operations (x: [..., T, head_dim]; cos, sin: [T, head_dim]; rotate_half(x) = cat(-x2, x1)).
at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The attention's projection split and rotated: qkv [B, T, 3, H, head_dim] -> q', k', v, each
// [B, H, T, head_dim], q' and k' rotated by rotary_reference. On the CPU (contiguous qkv) one pass
// forward and one backward, writing the projection's gradient directly, where the composition of
// ATen operations takes about five passes for the rotation (slice, neg, cat, two multiplies and an
// add), as many again for its gradient, and three zero-filled tensors summed for the projection's.
// Each element is the same rounded float operations as there, so values and gradients are those of
// the composition bit for bit (a zero's sign aside: the composition adds zero-filled tensors);
// elsewhere it is the composition.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin);

// softmax(q k^T / sqrt(D) + causal mask) v for q, k, v [B, H, T, D] (query i sees keys 0..i), the
// result [B, H, T, D] laid out [B, T, H, D] in memory. On the CPU in float32 (any strides) a kernel
// of row blocks of whole heads whose products go to LibTorch's BLAS (src/models/attention.cpp), and
// differentiable in q, k and v; elsewhere, or where LibTorch has no BLAS, causal_attention_reference:
// at::scaled_dot_product_attention(q, k, v, is_causal = true).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
at::Tensor causal_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// causal_attention(rotary_qkv(qkv, cos, sin)): the attention's projection qkv [B, T, 3, H, head_dim]
// to the attention's output [B, H, T, head_dim], laid out [B, T, H, head_dim] in memory. On the CPU
// in float32 (contiguous qkv, contiguous float32 cos and sin) one kernel rotates each head's q and k
// into a thread's scratch as it attends, reads v in place and writes the projection's gradient
// directly: none of the [B, H, T, head_dim] tensors of q, k, v and their gradients that the two
// calls write and read again. The same operations on the same values as the two calls, which it
// is elsewhere.
at::Tensor rotary_causal_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin);

// Whether causal_attention has its CPU kernel in this process (LibTorch's BLAS found).
bool causal_attention_available();

}  // namespace fsdpp::models
