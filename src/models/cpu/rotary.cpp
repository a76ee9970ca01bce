// The rotary embedding of q and k (models/cpu/kernels.hpp): the composition's bits, so this file is
// compiled without contraction into fused multiply-adds (-ffp-contract=off, CMakeLists.txt).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/bit_cast.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fsdpp/models/cpu/kernels.hpp"
#include "rotary_rows.hpp"
#include "vector_clones.hpp"

namespace fsdpp::models {

namespace {

at::Tensor rotate_half(const at::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Rotates x into y, both [B, H, T, D]; cos and sin are [T, D], or [B, T, D] (a table per sample). With lo and hi the first and second
// halves of the last dimension, forward:
//   y_lo = x_lo c_lo - x_hi s_lo,   y_hi = x_hi c_hi + x_lo s_hi
// and backward (x the output's gradient, y the input's):
//   y_lo = x_lo c_lo + x_hi s_hi,   y_hi = x_hi c_hi - x_lo s_lo
// Every product and sum is rounded to the tensors' dtype as ATen rounds each operation's result
// (a - b and a + (-b) are the same IEEE operation), which is what makes the results those of
// rotary_reference bit for bit (the same operations, each rounded, no fused multiply-adds).
//
// rotate_rows runs one slice of the B x H (batch, head) pairs: a loop over positions and the half
// inside it, for float32 and bfloat16 compiled per instruction set as a whole. A row's half is
// short (16 values at moe-small's head size 32, one AVX-512 vector of floats), so a call per row,
// as a TensorIterator's loop would make, costs more than the arithmetic.
struct RowLayout {
  int64_t B, H, T, half;
  int64_t y_b, y_h, y_t, x_b, x_h, x_t;  // element strides; the last dimension's is 1
  int64_t c_b = 0;                       // the tables' stride between samples: 0 when shared
};

// How rotate_rows_body reads and writes an element: in its dtype's math type (ATen's opmath:
// float for the 16-bit types) and back. bfloat16 is rounded to nearest even as c10::BFloat16
// rounds, NaN to its quiet NaN, written without a branch so that the loops vectorise.
template <typename T>
struct PlainElement {
  using Stored = T;
  using Math = at::opmath_type<T>;
  static Math load(T v) { return static_cast<Math>(v); }
  static T store(Math v) { return static_cast<T>(v); }
};
struct BFloat16Element {
  using Stored = uint16_t;  // a c10::BFloat16's bits
  using Math = float;
  static float load(uint16_t v) { return c10::bit_cast<float>(uint32_t(v) << 16); }
  static uint16_t store(float f) {
    const uint32_t u = c10::bit_cast<uint32_t>(f);
    const uint32_t rounded = (u + ((u >> 16) & 1) + UINT32_C(0x7FFF)) >> 16;
    return (u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000) ? uint16_t(0x7FC0) : uint16_t(rounded);
  }
};

// A head's rows are read and written a row stride apart (1,536 bytes in moe-small's projection),
// which the hardware's prefetchers follow poorly, and the projection is cold when the rotation
// first reads it: each row's cache lines are asked for this many rows ahead, the first rows' before
// the loop (bench/results/rotary_prefetch.md).
constexpr int64_t kRowsAhead = 16;

// Asks for the cache lines of p[0, n), to write them or to read: every 64 bytes from p, and the last
// byte's line, which an unaligned row reaches.
template <int Write, typename S>
C10_ALWAYS_INLINE void prefetch_row(const S* p, int64_t n) {
  const auto* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * int64_t(sizeof(S));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, Write);
  __builtin_prefetch(c + bytes - 1, Write);
}

template <typename E, typename S = typename E::Stored>
C10_ALWAYS_INLINE void rotate_rows_body(S* __restrict y, const S* __restrict x, const S* __restrict cos,
                                        const S* __restrict sin, const RowLayout& l, int64_t begin,
                                        int64_t end, bool backward) {
  using M = typename E::Math;
  // A product or sum as ATen's operation on the dtype gives it: computed in M, rounded.
  const auto r = [](M v) { return E::load(E::store(v)); };
  const int64_t h = l.half;
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / l.H, head = bh % l.H;
    S* const y_head = y + b * l.y_b + head * l.y_h;
    const S* const x_head = x + b * l.x_b + head * l.x_h;
    const S* const cos_b = cos + b * l.c_b;
    const S* const sin_b = sin + b * l.c_b;
    const auto ask = [&](int64_t t) {
      prefetch_row</*Write=*/0>(x_head + t * l.x_t, 2 * h);
      prefetch_row</*Write=*/1>(y_head + t * l.y_t, 2 * h);
    };
    for (int64_t t = 0; t < std::min(kRowsAhead, l.T); ++t) ask(t);
    for (int64_t t = 0; t < l.T; ++t) {
      if (t + kRowsAhead < l.T) ask(t + kRowsAhead);
      S* __restrict y_lo = y_head + t * l.y_t;
      const S* __restrict x_lo = x_head + t * l.x_t;
      S* __restrict y_hi = y_lo + h;
      const S* __restrict x_hi = x_lo + h;
      const S* __restrict c_lo = cos_b + t * 2 * h;
      const S* __restrict s_lo = sin_b + t * 2 * h;
      const S* __restrict c_hi = c_lo + h;
      const S* __restrict s_hi = s_lo + h;
      if (!backward)
        for (int64_t i = 0; i < h; ++i) {
          const M xl = E::load(x_lo[i]), xh = E::load(x_hi[i]);
          y_lo[i] = E::store(r(xl * E::load(c_lo[i])) - r(xh * E::load(s_lo[i])));
          y_hi[i] = E::store(r(xh * E::load(c_hi[i])) + r(xl * E::load(s_hi[i])));
        }
      else
        for (int64_t i = 0; i < h; ++i) {
          const M xl = E::load(x_lo[i]), xh = E::load(x_hi[i]);
          y_lo[i] = E::store(r(xl * E::load(c_lo[i])) + r(xh * E::load(s_hi[i])));
          y_hi[i] = E::store(r(xh * E::load(c_hi[i])) - r(xl * E::load(s_lo[i])));
        }
    }
  }
}

// Other dtypes (double, half): the same loop, compiled once.
template <typename T>
void rotate_rows(T* y, const T* x, const T* cos, const T* sin, const RowLayout& l, int64_t begin, int64_t end,
                 bool backward) {
  rotate_rows_body<PlainElement<T>>(y, x, cos, sin, l, begin, end, backward);
}

FSDPP_VECTOR_CLONES void rotate_rows(float* y, const float* x, const float* cos, const float* sin,
                                     const RowLayout& l, int64_t begin, int64_t end, bool backward) {
  rotate_rows_body<PlainElement<float>>(y, x, cos, sin, l, begin, end, backward);
}

FSDPP_VECTOR_CLONES void rotate_rows(c10::BFloat16* y, const c10::BFloat16* x, const c10::BFloat16* cos,
                                     const c10::BFloat16* sin, const RowLayout& l, int64_t begin, int64_t end,
                                     bool backward) {
  const auto bits = [](const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); };
  rotate_rows_body<BFloat16Element>(reinterpret_cast<uint16_t*>(y), bits(x), bits(cos), bits(sin), l, begin,
                                    end, backward);
}

// Elements between two samples' tables: 0 for one table of every sample.
int64_t per_sample(const at::Tensor& table) { return table.dim() == 3 ? table.size(1) * table.size(2) : 0; }

// y's last dimension is contiguous (made so by RotaryQKV), as are cos and sin (rotary_qkv's
// condition for the fused path); x's is read in place where it is contiguous (a view of the
// projection, the attention kernel's gradients) and from a contiguous copy otherwise (an expanded
// gradient, as a sum's backward gives).
void rotate_into(const at::Tensor& x_in, const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin,
                 bool backward) {
  TORCH_INTERNAL_ASSERT(y.stride(3) == 1 && cos.is_contiguous() && sin.is_contiguous());
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const RowLayout l{x.size(0),   x.size(1),   x.size(2),   x.size(3) / 2, y.stride(0),    y.stride(1),
                    y.stride(2), x.stride(0), x.stride(1), x.stride(2),   per_sample(cos)};
  // At least 32k elements a task, so that small calls stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, l.T * 2 * l.half));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fsdpp_rotary", [&] {
    using T = scalar_t;
    T* yp = y.data_ptr<T>();
    const T *xp = x.const_data_ptr<T>(), *cp = cos.const_data_ptr<T>(), *sp = sin.const_data_ptr<T>();
    at::parallel_for(0, l.B * l.H, grain, [&](int64_t begin, int64_t end) {
      rotate_rows(yp, xp, cp, sp, l, begin, end, backward);
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
    const auto layout = [&] {
      return at::empty({qkv.size(0), qkv.size(1), qkv.size(3), qkv.size(4)}, qkv.options());
    };
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

void detail::rotate_head(float* y, int64_t y_ld, const float* x, int64_t x_ld, const float* cos,
                         const float* sin, int64_t T, int64_t D, bool backward) {
  const RowLayout l{1, 1, T, D / 2, 0, 0, y_ld, 0, 0, x_ld};
  rotate_rows(y, x, cos, sin, l, 0, 1, backward);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t hd, const RopeSpec& rope,
                                                at::TensorOptions options) {
  at::NoGradGuard no_grad;
  const auto f = options.dtype(at::kFloat);
  // 1 / theta^(2j / hd) in float32, as transformers computes it (and so bit for bit its angles).
  auto inv_freq = 1.0 / at::pow(rope.theta, at::arange(0, hd, 2, f) / double(hd));
  if (rope.type == "linear") {
    inv_freq = inv_freq / rope.factor;
  } else if (rope.type == "llama3") {
    // Wavelengths longer than the original context / low_freq_factor slow by `factor`, shorter than
    // original / high_freq_factor stay, and those between move along a linear ramp in
    // original / wavelength.
    const double original = double(rope.original_max_seq_len);
    const auto wavelen = 2 * M_PI / inv_freq;
    const auto slowed =
        at::where(wavelen > original / rope.low_freq_factor, inv_freq / rope.factor, inv_freq);
    const auto smooth =
        (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
    const auto ramp = (1 - smooth) * slowed / rope.factor + smooth * slowed;
    const auto medium =
        (wavelen >= original / rope.high_freq_factor) & (wavelen <= original / rope.low_freq_factor);
    inv_freq = at::where(medium, ramp, slowed);
  } else if (rope.type != "default") {
    TORCH_CHECK(false, "rotary_tables: rope type \"", rope.type, "\" is not default, linear or llama3");
  }
  const auto angles = at::outer(at::arange(T, f), inv_freq);  // [T, hd/2]
  return {at::cat({angles.cos(), angles.cos()}, -1).to(options.dtype()),
          at::cat({angles.sin(), angles.sin()}, -1).to(options.dtype())};
}

at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (cos.dim() == 3) return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1);  // [B, 1, T, D]
  return x * cos + rotate_half(x) * sin;
}

std::pair<at::Tensor, at::Tensor> rotary_at(const std::pair<at::Tensor, at::Tensor>& tables,
                                            const at::Tensor& positions) {
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong,
              "rotary_at: positions must be int64 [B, T], got ", positions.scalar_type(), " ",
              positions.sizes());
  const auto B = positions.size(0), T = positions.size(1), D = tables.first.size(1);
  const auto at_rows = [&](const at::Tensor& t) {
    return t.index_select(0, positions.reshape({-1}).to(t.device())).view({B, T, D});
  };
  return {at_rows(tables.first), at_rows(tables.second)};
}

at::Tensor sequence_starts(const at::Tensor& positions) {
  return at::arange(positions.size(1), positions.options()).unsqueeze(0) - positions;
}

void detail::check_rotary_shapes(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qkv.dim() == 5 && qkv.size(2) == 3 && qkv.size(4) % 2 == 0,
              "rotary_qkv: expected [B, T, 3, H, D] with an even D, got ", qkv.sizes());
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(4);
  const bool shared = cos.sizes() == at::IntArrayRef({T, D}), own = cos.sizes() == at::IntArrayRef({B, T, D});
  TORCH_CHECK((shared || own) && sin.sizes() == cos.sizes(), "rotary_qkv: cos and sin must be [", T, ", ", D,
              "] or [", B, ", ", T, ", ", D, "], got ", cos.sizes(), " and ", sin.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin) {
  detail::check_rotary_shapes(qkv, cos, sin);
  const bool fused = qkv.is_cpu() && qkv.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                     sin.scalar_type() == qkv.scalar_type() && cos.is_contiguous() && sin.is_contiguous() &&
                     !cos.requires_grad() && !sin.requires_grad();
  if (!fused)
    return {rotary_reference(part(qkv, 0), cos, sin), rotary_reference(part(qkv, 1), cos, sin), part(qkv, 2)};
  auto out = RotaryQKV::apply(qkv, cos, sin);
  return {out[0], out[1], out[2]};
}

}  // namespace fsdpp::models
