// The rotary embedding of q and k (models/kernels.hpp): the composition's bits, so this file is
// compiled without contraction into fused multiply-adds (-ffp-contract=off, CMakeLists.txt).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <type_traits>

#include "fsdpp/models/kernels.hpp"
#include "vector_clones.hpp"

namespace fsdpp::models {

namespace {

at::Tensor rotate_half(const at::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Rotates x into y, both [B, H, T, D] with any strides; cos and sin are [T, D]. With lo and hi the
// first and second halves of the last dimension, forward:
//   y_lo = x_lo c_lo - x_hi s_lo,   y_hi = x_hi c_hi + x_lo s_hi
// and backward (x the output's gradient, y the input's):
//   y_lo = x_lo c_lo + x_hi s_hi,   y_hi = x_hi c_hi - x_lo s_lo
// Every product and sum is rounded to the tensors' dtype as ATen rounds each operation's result
// (a - b and a + (-b) are the same IEEE operation), which is what makes the results those of
// rotary_reference bit for bit (with float rows contiguous, rotate_span's vector loop: the same
// operations, each rounded, no fused multiply-adds). A TensorIterator lays out the loop and runs it
// on ATen's intra-op threads.
FSDPP_VECTOR_CLONES void rotate_span(float* __restrict y_lo, float* __restrict y_hi, const float* __restrict x_lo,
                                     const float* __restrict x_hi, const float* __restrict c_lo,
                                     const float* __restrict c_hi, const float* __restrict s_lo,
                                     const float* __restrict s_hi, int64_t n, bool backward) {
  if (!backward)
    for (int64_t i = 0; i < n; ++i) {
      y_lo[i] = x_lo[i] * c_lo[i] - x_hi[i] * s_lo[i];
      y_hi[i] = x_hi[i] * c_hi[i] + x_lo[i] * s_hi[i];
    }
  else
    for (int64_t i = 0; i < n; ++i) {
      y_lo[i] = x_lo[i] * c_lo[i] + x_hi[i] * s_hi[i];
      y_hi[i] = x_hi[i] * c_hi[i] - x_lo[i] * s_lo[i];
    }
}

void rotate_into(const at::Tensor& x, const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const int64_t h = x.size(3) / 2;
  auto lo = [h](const at::Tensor& t) { return t.narrow(-1, 0, h); };
  auto hi = [h](const at::Tensor& t) { return t.narrow(-1, h, h); };
  const at::Tensor halves[] = {lo(y), hi(y), lo(x), hi(x), lo(cos), hi(cos), lo(sin), hi(sin)};
  at::TensorIteratorConfig config;
  config.add_output(halves[0]).add_output(halves[1]).resize_outputs(false);
  for (int k = 2; k < 8; ++k) config.add_const_input(halves[k]);
  auto iter = config.build();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fsdpp_rotary", [&] {
    using T = scalar_t;
    using M = at::opmath_type<T>;
    auto mul = [](T a, T b) { return static_cast<T>(static_cast<M>(a) * static_cast<M>(b)); };
    auto add = [](T a, T b) { return static_cast<T>(static_cast<M>(a) + static_cast<M>(b)); };
    auto sub = [](T a, T b) { return static_cast<T>(static_cast<M>(a) - static_cast<M>(b)); };
    iter.for_each([&](char** data, const int64_t* strides, int64_t n0, int64_t n1) {
      constexpr int kTensors = 8;
      bool dense = std::is_same_v<T, float>;  // float rows laid out one after another: the vector loop
      for (int k = 0; k < kTensors; ++k) dense = dense && strides[k] == sizeof(T);
      for (int64_t j = 0; j < n1; ++j) {
        char* p[kTensors];
        for (int k = 0; k < kTensors; ++k) p[k] = data[k] + j * strides[kTensors + k];
        if (dense) {
          auto f = [&](int k) { return reinterpret_cast<float*>(p[k]); };
          rotate_span(f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), n0, backward);
          continue;
        }
        for (int64_t i = 0; i < n0; ++i) {
          auto v = [&](int k) -> T& { return *reinterpret_cast<T*>(p[k] + i * strides[k]); };
          const T x_lo = v(2), x_hi = v(3), c_lo = v(4), c_hi = v(5), s_lo = v(6), s_hi = v(7);
          if (!backward) {
            v(0) = sub(mul(x_lo, c_lo), mul(x_hi, s_lo));
            v(1) = add(mul(x_hi, c_hi), mul(x_lo, s_hi));
          } else {
            v(0) = add(mul(x_lo, c_lo), mul(x_hi, s_hi));
            v(1) = sub(mul(x_hi, c_hi), mul(x_lo, s_lo));
          }
        }
      }
    });
  });
}

// [B, T, 3, H, D] -> its q, k or v part as a [B, H, T, D] view.
at::Tensor part(const at::Tensor& qkv, int64_t i) { return qkv.select(2, i).permute({0, 2, 1, 3}); }

// The attention's projection [B, T, 3, H, D] (contiguous) -> rotated q, rotated k and v, each
// [B, H, T, D]. Its backward writes the projection's gradient in one pass, where the
// composition of selects, permutes and rotate_half builds it from three zero-filled tensors summed.
struct RotaryQKV : torch::autograd::Function<RotaryQKV> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                                                const at::Tensor& cos, const at::Tensor& sin) {
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    // Laid out [B, T, H, D] in memory, as the attention kernel keeps its own tensors.
    const auto layout = [&] { return at::empty({qkv.size(0), qkv.size(1), qkv.size(3), qkv.size(4)}, qkv.options()); };
    auto rq = layout().permute({0, 2, 1, 3}), rk = layout().permute({0, 2, 1, 3});
    rotate_into(part(qkv, 0), rq, cos, sin, false);
    rotate_into(part(qkv, 1), rk, cos, sin, false);
    return {rq, rk, layout().copy_(qkv.select(2, 2)).permute({0, 2, 1, 3})};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto cos = ctx->saved_data["cos"].toTensor(), sin = ctx->saved_data["sin"].toTensor();
    const auto& like = grads[0].defined() ? grads[0] : grads[1].defined() ? grads[1] : grads[2];
    const int64_t B = like.size(0), H = like.size(1), T = like.size(2), D = like.size(3);
    auto g = at::empty({B, T, 3, H, D}, like.options().memory_format(at::MemoryFormat::Contiguous));
    for (int64_t i = 0; i < 3; ++i) {
      const auto slot = part(g, i);
      if (!grads[i].defined())
        slot.zero_();
      else if (i < 2)
        rotate_into(grads[i], slot, cos, sin, true);
      else
        slot.copy_(grads[i]);
    }
    return {g, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t hd, double theta, at::TensorOptions options) {
  at::NoGradGuard no_grad;
  const auto f = options.dtype(at::kFloat);
  const auto inv_freq = at::pow(theta, -at::arange(0, hd, 2, f) / double(hd));
  const auto angles = at::outer(at::arange(T, f), inv_freq);  // [T, hd/2]
  return {at::cat({angles.cos(), angles.cos()}, -1).to(options.dtype()),
          at::cat({angles.sin(), angles.sin()}, -1).to(options.dtype())};
}

at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin) {
  TORCH_CHECK(qkv.dim() == 5 && qkv.size(2) == 3 && qkv.size(4) % 2 == 0,
              "rotary_qkv: expected [B, T, 3, H, D] with an even D, got ", qkv.sizes());
  const int64_t T = qkv.size(1), D = qkv.size(4);
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({T, D}) && sin.sizes() == cos.sizes(), "rotary_qkv: cos and sin must be [",
              T, ", ", D, "], got ", cos.sizes(), " and ", sin.sizes());
  const bool fused = qkv.is_cpu() && qkv.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                     sin.scalar_type() == qkv.scalar_type() && cos.is_contiguous() && sin.is_contiguous() &&
                     !cos.requires_grad() && !sin.requires_grad();
  if (!fused) return {rotary_reference(part(qkv, 0), cos, sin), rotary_reference(part(qkv, 1), cos, sin), part(qkv, 2)};
  auto out = RotaryQKV::apply(qkv, cos, sin);
  return {out[0], out[1], out[2]};
}

}  // namespace fsdpp::models
