#include "fsdpp/models/kernels.hpp"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include "fsdpp/base/parallel.hpp"
#include "float_loops.hpp"
#include "vector_clones.hpp"

namespace fsdpp::models {

namespace {

using loops::dot;
using loops::exp_poly;
using loops::kElementsPerTask;
using loops::rows_per_task;

// ------------------------------------------------------------------ float loops

inline float sigmoid(float a) { return 1.0f / (1.0f + exp_poly(-a)); }

// One row of RMSNorm: y = x * rstd * w, returns rstd.
FSDPP_VECTOR_CLONES float rms_row(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t n, float eps) {
  const float rstd = 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * rstd * w[i];
  return rstd;
}

// One row of RMSNorm's backward. With xhat = x rstd and gw = g w:
//   dx = rstd (gw - xhat mean(gw xhat)),   dw += g xhat  (added into dw_acc)
FSDPP_VECTOR_CLONES void rms_row_backward(const float* __restrict g, const float* __restrict x,
                                          const float* __restrict w, float rstd, float* __restrict dx,
                                          float* __restrict dw_acc, float* __restrict gw, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gw[i] = g[i] * w[i];
  const float c = rstd * rstd * rstd * dot(gw, x, n) / float(n);
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = rstd * gw[i] - c * x[i];
    dw_acc[i] += g[i] * (x[i] * rstd);
  }
}

// out[j] = sum over i of m[i][j] (m: rows x cols, row-major), rows added in order.
FSDPP_VECTOR_CLONES void sum_rows(const float* __restrict m, int64_t rows, int64_t cols, float* __restrict out) {
  for (int64_t j = 0; j < cols; ++j) out[j] = 0.0f;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j] += m[i * cols + j];
}

FSDPP_VECTOR_CLONES void swiglu_span(const float* __restrict a, const float* __restrict b, float* __restrict out,
                                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * sigmoid(a[i]) * b[i];
}

// d/da silu(a) = s (1 + a (1 - s)) with s = sigmoid(a).
FSDPP_VECTOR_CLONES void swiglu_span_backward(const float* __restrict g, const float* __restrict a,
                                              const float* __restrict b, float* __restrict da, float* __restrict db,
                                              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(a[i]);
    db[i] = g[i] * (a[i] * s);
    da[i] = g[i] * b[i] * (s * (1.0f + a[i] * (1.0f - s)));
  }
}

// ------------------------------------------------------------------ dtypes and threads

// bfloat16 <-> float, written so that the loops vectorise: widening puts the 16 bits on top,
// narrowing rounds to nearest even and keeps NaN a (quiet) NaN, as c10::BFloat16's conversion does.
FSDPP_VECTOR_CLONES void widen(const c10::BFloat16* __restrict p, float* __restrict out, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(p);
  for (int64_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(uint32_t(bits[i]) << 16);
}
FSDPP_VECTOR_CLONES void narrow(const float* __restrict f, c10::BFloat16* __restrict p, int64_t n) {
  auto* bits = reinterpret_cast<uint16_t*>(p);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(f[i]);
    const auto rounded = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    bits[i] = f[i] != f[i] ? uint16_t(0x7fc0) : rounded;
  }
}

// Reads `n` values of T as floats: the values themselves for float, else converted into `scratch`.
template <class T>
const float* as_float(const T* p, int64_t n, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    scratch.resize(size_t(n));
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      widen(p, scratch.data(), n);
    else
      for (int64_t i = 0; i < n; ++i) scratch[size_t(i)] = static_cast<float>(p[i]);
    return scratch.data();
  }
}

// Where float results for `n` values of T go: `p` itself for float, else `scratch`, copied by store().
template <class T>
float* float_out(T* p, int64_t n, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    scratch.resize(size_t(n));
    return scratch.data();
  }
}
template <class T>
void store(T* p, const float* f, int64_t n) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    narrow(f, p, n);
  else if constexpr (!std::is_same_v<T, float>)
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(f[i]);
}

bool fusable(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return t.is_cpu() && (s == at::kFloat || s == at::kBFloat16 || s == at::kHalf);
}

// Rows of RMSNorm's backward are summed into the weight's gradient a block at a time, each block's
// sum in row order, then the blocks' sums in block order: the same bits however the blocks fall on
// threads.
constexpr int64_t kRowsPerBlock = 32;

struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& weight,
                            double eps) {
    const auto x = x_in.contiguous();
    const int64_t D = x.size(-1), N = D ? x.numel() / D : 0;
    const auto w = weight.to(at::kFloat).contiguous();
    auto y = at::empty_like(x);
    auto rstd = at::empty({N}, x.options().dtype(at::kFloat));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fsdpp_rms_norm", [&] {
      const auto* xp = x.const_data_ptr<scalar_t>();
      auto* yp = y.mutable_data_ptr<scalar_t>();
      auto* rp = rstd.mutable_data_ptr<float>();
      const float* wp = w.const_data_ptr<float>();
      parallel_ranges(N, rows_per_task(D), [&](int64_t r0, int64_t r1) {
        std::vector<float> xs, ys;
        for (int64_t r = r0; r < r1; ++r) {
          const float* xf = as_float(xp + r * D, D, xs);
          float* yf = float_out(yp + r * D, D, ys);
          rp[r] = rms_row(xf, wp, yf, D, static_cast<float>(eps));
          store(yp + r * D, yf, D);
        }
      });
    });
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &rstd = saved[2];  // w: the gain in float32
    const auto g = grads[0].contiguous();
    const int64_t D = x.size(-1), N = D ? x.numel() / D : 0, blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
    auto dx = at::empty_like(x);
    auto dw_blocks = at::zeros({blocks, D}, x.options().dtype(at::kFloat));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fsdpp_rms_norm_backward", [&] {
      const auto* xp = x.const_data_ptr<scalar_t>();
      const auto* gp = g.const_data_ptr<scalar_t>();
      auto* dxp = dx.mutable_data_ptr<scalar_t>();
      const float* rp = rstd.const_data_ptr<float>();
      const float* wp = w.const_data_ptr<float>();
      float* dwp = dw_blocks.mutable_data_ptr<float>();
      const int64_t grain = rows_per_task(D * kRowsPerBlock);
      parallel_ranges(blocks, grain, [&](int64_t b0, int64_t b1) {
        std::vector<float> xs, gs, dxs, gw(static_cast<size_t>(D));
        for (int64_t b = b0; b < b1; ++b)
          for (int64_t r = b * kRowsPerBlock; r < std::min(N, (b + 1) * kRowsPerBlock); ++r) {
            const float* xf = as_float(xp + r * D, D, xs);
            const float* gf = as_float(gp + r * D, D, gs);
            float* dxf = float_out(dxp + r * D, D, dxs);
            rms_row_backward(gf, xf, wp, rp[r], dxf, dwp + b * D, gw.data(), D);
            store(dxp + r * D, dxf, D);
          }
      });
    });
    auto dw = at::empty({D}, dw_blocks.options());
    sum_rows(dw_blocks.const_data_ptr<float>(), blocks, D, dw.mutable_data_ptr<float>());
    return {dx, dw.to(static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt())), at::Tensor()};
  }
};

// float32 only (swiglu() sends every other dtype to the composition).
struct SwiGLUFunction : torch::autograd::Function<SwiGLUFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a_in, const at::Tensor& b_in) {
    const auto a = a_in.contiguous(), b = b_in.contiguous();
    auto out = at::empty_like(a);
    const float *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>();
    float* op = out.mutable_data_ptr<float>();
    parallel_ranges(a.numel(), kElementsPerTask,
                    [&](int64_t i0, int64_t i1) { swiglu_span(ap + i0, bp + i0, op + i0, i1 - i0); });
    ctx->save_for_backward({a, b});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &a = saved[0], &b = saved[1];
    const auto g = grads[0].contiguous();
    auto da = at::empty_like(a), db = at::empty_like(b);
    const float *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>(), *gp = g.const_data_ptr<float>();
    float *dap = da.mutable_data_ptr<float>(), *dbp = db.mutable_data_ptr<float>();
    parallel_ranges(a.numel(), kElementsPerTask, [&](int64_t i0, int64_t i1) {
      swiglu_span_backward(gp + i0, ap + i0, bp + i0, dap + i0, dbp + i0, i1 - i0);
    });
    return {da, db};
  }
};

}  // namespace

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto xf = x.to(at::kFloat);
  const auto y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (y * weight.to(at::kFloat)).to(x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight ",
              weight.sizes(), " does not match the last dimension of x ", x.sizes());
  if (!fusable(x) || !weight.is_cpu()) return rms_norm_reference(x, weight, eps);
  return RMSNormFunction::apply(x, weight, eps);
}

at::Tensor swiglu_reference(const at::Tensor& a, const at::Tensor& b) { return at::silu(a) * b; }

at::Tensor swiglu(const at::Tensor& a, const at::Tensor& b) {
  // float32 only: with bfloat16 halves the conversions cost more than the passes saved
  // (bench/results/kernels.md).
  if (!a.is_cpu() || !b.is_cpu() || a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat ||
      a.sizes() != b.sizes())
    return swiglu_reference(a, b);
  return SwiGLUFunction::apply(a, b);
}

}  // namespace fsdpp::models
