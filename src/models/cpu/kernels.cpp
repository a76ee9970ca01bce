#include "fsdpp/models/cpu/kernels.hpp"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <type_traits>
#include <vector>

#include "blas_gemm.hpp"
#include "fsdpp/base/parallel.hpp"
#include "fsdpp/models/cpu/matmul.hpp"
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
FSDPP_VECTOR_CLONES float rms_row(const float* __restrict x, const float* __restrict w, float* __restrict y,
                                  int64_t n, float eps) {
  const float rstd = 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * rstd * w[i];
  return rstd;
}

// One row of RMSNorm's backward. With xhat = x rstd and gw = g w:
//   dx = rstd (gw - xhat mean(gw xhat)) + skip,   dw += g xhat  (added into dw_acc)
// skip: the gradient x has from elsewhere (the residual path), or null for none.
FSDPP_VECTOR_CLONES void rms_row_backward(const float* __restrict g, const float* __restrict x,
                                          const float* __restrict w, float rstd, const float* __restrict skip,
                                          float* __restrict dx, float* __restrict dw_acc,
                                          float* __restrict gw, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gw[i] = g[i] * w[i];
  const float c = rstd * rstd * rstd * dot(gw, x, n) / float(n);
  if (skip) {
    for (int64_t i = 0; i < n; ++i) {
      dx[i] = rstd * gw[i] - c * x[i] + skip[i];
      dw_acc[i] += g[i] * (x[i] * rstd);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      dx[i] = rstd * gw[i] - c * x[i];
      dw_acc[i] += g[i] * (x[i] * rstd);
    }
  }
}

FSDPP_VECTOR_CLONES void add_span(const float* __restrict a, const float* __restrict b, float* __restrict out,
                                  int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// out[j] = sum over i of m[i][j] (m: rows x cols, row-major), rows added in order.
FSDPP_VECTOR_CLONES void sum_rows(const float* __restrict m, int64_t rows, int64_t cols,
                                  float* __restrict out) {
  for (int64_t j = 0; j < cols; ++j) out[j] = 0.0f;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j] += m[i * cols + j];
}

FSDPP_VECTOR_CLONES void swiglu_span(const float* __restrict a, const float* __restrict b,
                                     float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * sigmoid(a[i]) * b[i];
}

// d/da silu(a) = s (1 + a (1 - s)) with s = sigmoid(a).
FSDPP_VECTOR_CLONES void swiglu_span_backward(const float* __restrict g, const float* __restrict a,
                                              const float* __restrict b, float* __restrict da,
                                              float* __restrict db, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(a[i]);
    db[i] = g[i] * (a[i] * s);
    da[i] = g[i] * b[i] * (s * (1.0f + a[i] * (1.0f - s)));
  }
}

// swiglu_span_backward that also writes the gate itself (swiglu_span's bits) into `gate`: one
// sigmoid an element where recomputing the gate and then its backward take two.
FSDPP_VECTOR_CLONES void swiglu_span_backward_and_gate(const float* __restrict g, const float* __restrict a,
                                                       const float* __restrict b, float* __restrict gate,
                                                       float* __restrict da, float* __restrict db,
                                                       int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(a[i]);
    gate[i] = a[i] * s * b[i];
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

// RMSNorm of x + r (r undefined: of x alone). Outputs the sum (x itself without r) and the norm;
// backward sums the sum's own gradient into the norm's input gradient in the same pass, so that the
// residual stream's two gradients need no separate add.
struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  // r as an optional: autograd's apply takes an undefined Tensor argument for a missing one.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in,
                                                const std::optional<at::Tensor>& r_in,
                                                const at::Tensor& weight, double eps) {
    const bool residual = r_in.has_value();
    const auto x = x_in.contiguous(), r = residual ? r_in->contiguous() : at::Tensor();
    const int64_t D = x.size(-1), N = D ? x.numel() / D : 0;
    const auto w = weight.to(at::kFloat).contiguous();
    const auto sum = residual ? at::empty_like(x) : x;
    auto y = at::empty_like(x);
    auto rstd = at::empty({N}, x.options().dtype(at::kFloat));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fsdpp_rms_norm", [&] {
      const auto* xp = x.const_data_ptr<scalar_t>();
      const auto* rp = residual ? r.const_data_ptr<scalar_t>() : nullptr;
      auto* sp = residual ? sum.mutable_data_ptr<scalar_t>() : nullptr;
      auto* yp = y.mutable_data_ptr<scalar_t>();
      auto* rstdp = rstd.mutable_data_ptr<float>();
      const float* wp = w.const_data_ptr<float>();
      parallel_ranges(N, rows_per_task(D), [&](int64_t r0, int64_t r1) {
        std::vector<float> xs, rs, ss, ys;
        for (int64_t i = r0; i < r1; ++i) {
          const float* xf = as_float(xp + i * D, D, xs);
          if (residual) {
            // The sum in x's dtype, and the norm of that rounded sum (as the composition computes).
            float* sf = float_out(sp + i * D, D, ss);
            add_span(xf, as_float(rp + i * D, D, rs), sf, D);
            store(sp + i * D, sf, D);
            xf = as_float(sp + i * D, D, xs);
          }
          float* yf = float_out(yp + i * D, D, ys);
          rstdp[i] = rms_row(xf, wp, yf, D, static_cast<float>(eps));
          store(yp + i * D, yf, D);
        }
      });
    });
    ctx->set_materialize_grads(false);  // an output without a gradient costs no pass over zeros
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["residual"] = residual;
    ctx->save_for_backward({sum, w, rstd});
    return {sum, y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &rstd = saved[2];  // x: the sum; w: the gain in float32
    const bool residual = ctx->saved_data["residual"].toBool();
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    const auto skip = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    if (!grads[1].defined()) {  // the norm unused: the sum's gradient is all there is
      return {skip, residual ? skip : at::Tensor(), at::zeros(w.sizes(), w.options().dtype(weight_dtype)),
              at::Tensor()};
    }
    const auto g = grads[1].contiguous();
    const int64_t D = x.size(-1), N = D ? x.numel() / D : 0, blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
    auto dx = at::empty_like(x);
    auto dw_blocks = at::zeros({blocks, D}, x.options().dtype(at::kFloat));
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, x.scalar_type(), "fsdpp_rms_norm_backward", [&] {
          const auto* xp = x.const_data_ptr<scalar_t>();
          const auto* gp = g.const_data_ptr<scalar_t>();
          const auto* kp = skip.defined() ? skip.const_data_ptr<scalar_t>() : nullptr;
          auto* dxp = dx.mutable_data_ptr<scalar_t>();
          const float* rp = rstd.const_data_ptr<float>();
          const float* wp = w.const_data_ptr<float>();
          float* dwp = dw_blocks.mutable_data_ptr<float>();
          const int64_t grain = rows_per_task(D * kRowsPerBlock);
          parallel_ranges(blocks, grain, [&](int64_t b0, int64_t b1) {
            std::vector<float> xs, gs, ks, dxs, gw(static_cast<size_t>(D));
            for (int64_t b = b0; b < b1; ++b)
              for (int64_t r = b * kRowsPerBlock; r < std::min(N, (b + 1) * kRowsPerBlock); ++r) {
                const float* xf = as_float(xp + r * D, D, xs);
                const float* gf = as_float(gp + r * D, D, gs);
                const float* kf = kp ? as_float(kp + r * D, D, ks) : nullptr;
                float* dxf = float_out(dxp + r * D, D, dxs);
                rms_row_backward(gf, xf, wp, rp[r], kf, dxf, dwp + b * D, gw.data(), D);
                store(dxp + r * D, dxf, D);
              }
          });
        });
    auto dw = at::empty({D}, dw_blocks.options());
    sum_rows(dw_blocks.const_data_ptr<float>(), blocks, D, dw.mutable_data_ptr<float>());
    // x and r are summed with weight one: the same gradient for both.
    return {dx, residual ? dx : at::Tensor(), dw.to(weight_dtype), at::Tensor()};
  }
};

// float32 only (swiglu() sends every other dtype to the composition).
struct SwiGLUFunction : torch::autograd::Function<SwiGLUFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a_in,
                            const at::Tensor& b_in) {
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
    const float *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>(),
                *gp = g.const_data_ptr<float>();
    float *dap = da.mutable_data_ptr<float>(), *dbp = db.mutable_data_ptr<float>();
    parallel_ranges(a.numel(), kElementsPerTask, [&](int64_t i0, int64_t i1) {
      swiglu_span_backward(gp + i0, ap + i0, bp + i0, dap + i0, dbp + i0, i1 - i0);
    });
    return {da, db};
  }
};

// ------------------------------------------------------------------ the experts' SwiGLU

// Each thread's scratch for a chunk's rows: four [chunk, hidden] blocks.
float* expert_scratch(int64_t chunk, int64_t hidden) {
  thread_local std::vector<float> buf;
  const auto n = size_t(4 * chunk * hidden);
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// x [N, D], w1 and w3 [E, H, D], w2 [E, D, H]; expert e takes rows [ends[e-1], ends[e]).
struct ExpertShape {
  int64_t E, H, D, chunk;  // chunk: rows of an expert taken at a time
  std::vector<int64_t> ends;
  int64_t begin(int64_t e) const { return e > 0 ? ends[size_t(e - 1)] : 0; }
};

struct ExpertSwiGLUFunction : torch::autograd::Function<ExpertSwiGLUFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in,
                            const at::Tensor& w1_in, const at::Tensor& w3_in, const at::Tensor& w2_in,
                            std::vector<int64_t> ends, int64_t chunk) {
    const auto x = x_in.contiguous(), w1 = w1_in.contiguous(), w3 = w3_in.contiguous(),
               w2 = w2_in.contiguous();
    const ExpertShape s{w1.size(0), w1.size(1), w1.size(2), chunk, std::move(ends)};
    const int64_t H = s.H, D = s.D, C = s.chunk, grouped = s.ends.empty() ? 0 : s.ends.back();
    auto a = at::empty({x.size(0), H}, x.options()), b = at::empty_like(a), y = at::empty_like(x);
    y.narrow(0, grouped, x.size(0) - grouped).zero_();
    // Chunks of every expert's rows, in order: each computed whole on one thread.
    std::vector<std::pair<int64_t, int64_t>> chunks;  // (expert, first row)
    for (int64_t e = 0; e < s.E; ++e)
      for (int64_t r = s.begin(e); r < s.ends[size_t(e)]; r += C) chunks.emplace_back(e, r);
    const float *X = x.const_data_ptr<float>(), *W1 = w1.const_data_ptr<float>(),
                *W3 = w3.const_data_ptr<float>(), *W2 = w2.const_data_ptr<float>();
    float *A = a.mutable_data_ptr<float>(), *B = b.mutable_data_ptr<float>(),
          *Y = y.mutable_data_ptr<float>();
    parallel_ranges(int64_t(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
      const detail::BlasOnThisThread one_thread;
      float* g = expert_scratch(C, H);
      for (int64_t c = c0; c < c1; ++c) {
        const auto [e, r] = chunks[size_t(c)];
        const int64_t n = std::min(C, s.ends[size_t(e)] - r), w = e * H * D;
        detail::gemm(false, true, n, H, D, 1.0f, X + r * D, D, W1 + w, D, 0.0f, A + r * H, H);
        detail::gemm(false, true, n, H, D, 1.0f, X + r * D, D, W3 + w, D, 0.0f, B + r * H, H);
        swiglu_span(A + r * H, B + r * H, g, n * H);
        detail::gemm(false, true, n, D, H, 1.0f, g, H, W2 + w, H, 0.0f, Y + r * D, D);
      }
    });
    ctx->save_for_backward({x, w1, w3, w2, a, b});
    ctx->saved_data["ends"] = s.ends;
    ctx->saved_data["chunk"] = C;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w1 = saved[1], &w3 = saved[2], &w2 = saved[3], &a = saved[4], &b = saved[5];
    const ExpertShape s{w1.size(0), w1.size(1), w1.size(2), ctx->saved_data["chunk"].toInt(),
                        ctx->saved_data["ends"].toIntVector()};
    const int64_t H = s.H, D = s.D, C = s.chunk, grouped = s.ends.empty() ? 0 : s.ends.back();
    const auto dy = grads[0].contiguous();
    auto dx = at::empty_like(x), dw1 = at::empty_like(w1), dw3 = at::empty_like(w3), dw2 = at::empty_like(w2);
    dx.narrow(0, grouped, x.size(0) - grouped).zero_();
    const float *X = x.const_data_ptr<float>(), *W1 = w1.const_data_ptr<float>(),
                *W3 = w3.const_data_ptr<float>(), *W2 = w2.const_data_ptr<float>(),
                *A = a.const_data_ptr<float>(), *B = b.const_data_ptr<float>(),
                *dY = dy.const_data_ptr<float>();
    float *dX = dx.mutable_data_ptr<float>(), *dW1 = dw1.mutable_data_ptr<float>(),
          *dW3 = dw3.mutable_data_ptr<float>(), *dW2 = dw2.mutable_data_ptr<float>();
    // An expert's chunks in order on one thread: its weights' gradients are the chunks' products
    // summed in that order, whatever the thread count.
    parallel_ranges(s.E, 1, [&](int64_t e0, int64_t e1) {
      const detail::BlasOnThisThread one_thread;
      float* scratch = expert_scratch(C, H);
      float *g = scratch, *dg = g + C * H, *da = dg + C * H, *db = da + C * H;
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t w = e * H * D;
        if (s.begin(e) == s.ends[size_t(e)]) {  // no rows: no gradient
          std::fill(dW1 + w, dW1 + w + H * D, 0.0f);
          std::fill(dW3 + w, dW3 + w + H * D, 0.0f);
          std::fill(dW2 + w, dW2 + w + H * D, 0.0f);
          continue;
        }
        for (int64_t r = s.begin(e); r < s.ends[size_t(e)]; r += C) {
          const int64_t n = std::min(C, s.ends[size_t(e)] - r);
          const float acc = r == s.begin(e) ? 0.0f : 1.0f;  // the first chunk starts each weight's gradient
          detail::gemm(false, false, n, H, D, 1.0f, dY + r * D, D, W2 + w, H, 0.0f, dg, H);
          // The gate again (not kept from forward) in the same pass as its backward.
          swiglu_span_backward_and_gate(dg, A + r * H, B + r * H, g, da, db, n * H);
          detail::gemm(true, false, D, H, n, 1.0f, dY + r * D, D, g, H, acc, dW2 + w, H);
          detail::gemm(false, false, n, D, H, 1.0f, da, H, W1 + w, D, 0.0f, dX + r * D, D);
          detail::gemm(false, false, n, D, H, 1.0f, db, H, W3 + w, D, 1.0f, dX + r * D,
                       D);  // x's two parts summed
          detail::gemm(true, false, H, D, n, 1.0f, da, H, X + r * D, D, acc, dW1 + w, D);
          detail::gemm(true, false, H, D, n, 1.0f, db, H, X + r * D, D, acc, dW3 + w, D);
        }
      }
    });
    return {dx, dw1, dw3, dw2, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto xf = x.to(at::kFloat);
  const auto y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (y * weight.to(at::kFloat)).to(x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return residual_rms_norm(x, at::Tensor(), weight, eps).second;
}

std::pair<at::Tensor, at::Tensor> residual_rms_norm_reference(const at::Tensor& x, const at::Tensor& r,
                                                              const at::Tensor& weight, double eps) {
  const auto sum = r.defined() ? x + r : x;
  return {sum, rms_norm_reference(sum, weight, eps)};
}

std::pair<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                    const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight ",
              weight.sizes(), " does not match the last dimension of x ", x.sizes());
  if (r.defined())
    TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type(), "residual_rms_norm: r ",
                r.sizes(), " ", r.scalar_type(), " does not match x ", x.sizes(), " ", x.scalar_type());
  if (!fusable(x) || !weight.is_cpu() || (r.defined() && !r.is_cpu()))
    return residual_rms_norm_reference(x, r, weight, eps);
  auto out =
      RMSNormFunction::apply(x, r.defined() ? std::optional<at::Tensor>(r) : std::nullopt, weight, eps);
  return {out[0], out[1]};
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

at::Tensor expert_swiglu_reference(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                                   const at::Tensor& w2, const at::Tensor& ends) {
  return grouped_linear(swiglu(grouped_linear(x, w1, ends, false), grouped_linear(x, w3, ends, false)), w2,
                        ends, false);
}

at::Tensor expert_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                         const at::Tensor& w2, const at::Tensor& ends, int64_t chunk_rows) {
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && w3.sizes() == w1.sizes() && w2.dim() == 3 &&
                  w2.size(0) == w1.size(0) && w2.size(1) == w1.size(2) && w2.size(2) == w1.size(1) &&
                  x.size(1) == w1.size(2),
              "expert_swiglu: x [rows, dim], w1 and w3 [experts, hidden, dim], w2 [experts, dim, hidden] "
              "expected, got x ",
              x.sizes(), ", w1 ", w1.sizes(), ", w3 ", w3.sizes(), ", w2 ", w2.sizes());
  TORCH_CHECK(chunk_rows >= 1, "expert_swiglu: chunk_rows must be at least 1, got ", chunk_rows);
  bool kernel = detail::blas_available() && ends.is_cpu();
  for (const auto* t : {&x, &w1, &w3, &w2}) kernel = kernel && t->is_cpu() && t->scalar_type() == at::kFloat;
  if (!kernel) return expert_swiglu_reference(x, w1, w3, w2, ends);
  return ExpertSwiGLUFunction::apply(
      x, w1, w3, w2, detail::group_ends(ends, x.size(0), w1.size(0), "expert_swiglu"), chunk_rows);
}

}  // namespace fsdpp::models
