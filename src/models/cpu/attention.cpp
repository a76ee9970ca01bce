// Causal self-attention on the CPU in row blocks of whole heads (models/cpu/kernels.hpp).
//
// For each head, and each block of kBlockRows query rows [r0, r1), the keys the block can see are
// [0, r1). Forward:
//   S = scale Q[r0:r1] K[0:r1]^T                     one BLAS product
//   P = softmax(S) by rows, zero above the diagonal, and lse = log sum exp of each row's S
//   O[r0:r1] = P V[0:r1]                             one BLAS product
// Backward, with D_i = dO_i . O_i, blocks taken last to first (the last sees every key, so its
// products start dK and dV and the others add to them):
//   P = exp(S - lse) recomputed from one product, zero above the diagonal
//   dV[0:r1] += P^T dO[r0:r1],   dP = dO[r0:r1] V[0:r1]^T,   dS = scale P (dP - D)
//   dQ[r0:r1] = dS K[0:r1],      dK[0:r1] += dS^T Q[r0:r1]
// A block's S and dP stay in a thread's cache; nothing [T, T] is kept between forward and backward.
// Heads run on ATen's intra-op threads, each head and its products on one thread, so the results
// do not depend on how many there are. The products go to ATen's BLAS (MKL in PyTorch's wheels),
// called once per block where ATen's flash attention calls it per 32 x 32 tile.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fsdpp/base/parallel.hpp"
#include "blas_gemm.hpp"
#include "fsdpp/models/cpu/kernels.hpp"
#include "float_loops.hpp"
#include "rotary_rows.hpp"
#include "vector_clones.hpp"

namespace fsdpp::models {

namespace {

using detail::BlasOnThisThread;
using detail::gemm;
using loops::exp_poly;
using loops::kLanes;

// Query rows per block. With causal masking a head of T rows computes (T / rows + 1) / (2 T / rows)
// of the full T x T products: 5/8 at 32 rows and T = 128, 3/4 at 64, all of them at 128; smaller
// blocks make smaller, slower products. At moe-small's shape (T = 128, 32 per head) 64 rows took
// 0.72-0.74 of ATen's flash attention's time at 1 and 2 threads, 32 rows 0.75-0.81, 128 rows
// 0.79-0.90 (bench/attention_bench.cpp, each block size in turn).
constexpr int64_t kBlockRows = 64;

// How far a row's vector loops run: n rounded up to whole vectors where the row holds them (the lanes
// past n are masked: they read scores nobody sees and write zeros, which the row wants there), else
// n's whole vectors, the rest left to a scalar loop. A causal row is short (n is its position plus
// one, 64 on average at moe-small's length) and rarely whole vectors: a scalar tail of up to 15
// elements, each a scalar exp_poly, cost about as much as the row's vectors
// (bench/results/softmax_tail_attention.md, bench/results/softmax_tail.md).
inline int64_t vector_end(int64_t n, int64_t len) {
  const int64_t whole = (n + kLanes - 1) / kLanes * kLanes;
  return whole <= len ? whole : n / kLanes * kLanes;
}

// One row of scores s[0, len) whose first n are visible: s becomes the softmax over those n and
// zero past them; returns log sum exp of the visible scores. Lane k of the sums takes the visible
// elements k, k + kLanes, ..., whichever loop reaches them.
FSDPP_VECTOR_CLONES float softmax_row(float* __restrict s, int64_t n, int64_t len) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float mx[kLanes];
  for (int k = 0; k < kLanes; ++k) mx[k] = kNone;
  const auto max_into = [&mx](const float* __restrict p) {
    for (int k = 0; k < kLanes; ++k) mx[k] = p[k] > mx[k] ? p[k] : mx[k];
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) max_into(s + j);
  // A maximum may see an element twice: the last partial vector is read as the last whole one.
  if (j < n && n >= kLanes) max_into(s + n - kLanes), j = n;
  float m = kNone;
  for (; j < n; ++j) m = s[j] > m ? s[j] : m;
  for (int k = 0; k < kLanes; ++k) m = mx[k] > m ? mx[k] : m;
  const int64_t end = vector_end(n, len);
  float acc[kLanes] = {};
  for (j = 0; j < end; j += kLanes) {
    const int visible = int(std::min<int64_t>(n - j, kLanes));
    for (int k = 0; k < kLanes; ++k) {
      const float e = k < visible ? exp_poly(s[j + k] - m) : 0.0f;
      s[j + k] = e;
      acc[k] += e;
    }
  }
  for (; j < n; ++j) acc[j % kLanes] += (s[j] = exp_poly(s[j] - m));
  float l = 0.0f;
  for (int k = 0; k < kLanes; ++k) l += acc[k];
  const float inv = 1.0f / l;
  for (j = 0; j < end; j += kLanes)
    for (int k = 0; k < kLanes; ++k) s[j + k] *= inv;  // the masked lanes are zeros already
  for (; j < n; ++j) s[j] *= inv;
  for (j = std::max(n, end); j < len; ++j) s[j] = 0.0f;
  return m + std::log(l);
}

// The backward's probabilities again: s[j] = exp(s[j] - lse) for the n visible, zero past them.
FSDPP_VECTOR_CLONES void probs_row(float* __restrict s, float lse, int64_t n, int64_t len) {
  const int64_t end = vector_end(n, len);
  int64_t j = 0;
  for (; j < end; j += kLanes) {
    const int visible = int(std::min<int64_t>(n - j, kLanes));
    for (int k = 0; k < kLanes; ++k) s[j + k] = k < visible ? exp_poly(s[j + k] - lse) : 0.0f;
  }
  for (; j < n; ++j) s[j] = exp_poly(s[j] - lse);
  for (j = std::max(n, end); j < len; ++j) s[j] = 0.0f;
}

// dS = scale P (dP - D) in place of dP.
FSDPP_VECTOR_CLONES void dscores_row(const float* __restrict p, float* __restrict dp, float d, float scale,
                                     int64_t len) {
  for (int64_t j = 0; j < len; ++j) dp[j] = scale * p[j] * (dp[j] - d);
}

// One head of a [B, H, T, D] tensor: rows of D floats, `ld` apart.
struct Head {
  float* p;
  int64_t ld;
};

Head head(const at::Tensor& x, int64_t bh) {
  const int64_t H = x.size(1);
  return {const_cast<float*>(x.const_data_ptr<float>()) + (bh / H) * x.stride(0) + (bh % H) * x.stride(1),
          x.stride(2)};
}

// [B, H, T, D] laid out [B, T, H, D] in memory, as the model's tensors around attention are.
at::Tensor like_heads(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).permute({0, 2, 1, 3});
}

// A thread's scratch: slot 0 the blocks' scores (forward_head, backward_head), slot 1 a head's
// rotated rows and their gradients (RotaryCausalAttention).
std::vector<float>& scratch(size_t n, int slot = 0) {
  thread_local std::vector<float> bufs[2];
  auto& buf = bufs[slot];
  if (buf.size() < n) buf.resize(n);
  return buf;
}

// Packed samples: the first key each query row sees (sequence_starts), null when every row sees
// keys from 0. A block of rows [r0, r1) multiplies keys [first, r1), first its rows' least start.
struct Starts {
  const int64_t* p = nullptr;
  int64_t first(int64_t r0, int64_t r1) const {
    if (!p) return 0;
    int64_t f = p[r0];
    for (int64_t i = r0 + 1; i < r1; ++i) f = std::min(f, p[i]);
    return f;
  }
  int64_t of(int64_t i) const { return p ? p[i] : 0; }
};

// Row i of a block whose keys start at `first`: its scores s[0, keys), of which keys
// [start_i - first, i + 1 - first) are visible; the others become zeros.
template <typename Row>
void visible_row(float* s, int64_t lead, int64_t n, int64_t keys, Row&& row) {
  std::fill(s, s + lead, 0.0f);
  row(s + lead, n - lead, keys - lead);
}

void forward_head(Head q, Head k, Head v, Head o, float* lse, int64_t T, int64_t D, float scale, Starts st) {
  const BlasOnThisThread one_thread;
  float* s = scratch(size_t(kBlockRows * T)).data();
  for (int64_t r0 = 0; r0 < T; r0 += kBlockRows) {
    const int64_t r1 = std::min(T, r0 + kBlockRows), rows = r1 - r0, k0 = st.first(r0, r1), keys = r1 - k0;
    gemm(false, true, rows, keys, D, scale, q.p + r0 * q.ld, q.ld, k.p + k0 * k.ld, k.ld, 0.0f, s, keys);
    for (int64_t i = 0; i < rows; ++i)
      visible_row(s + i * keys, st.of(r0 + i) - k0, r0 + i + 1 - k0, keys,
                  [&](float* row, int64_t n, int64_t len) { lse[r0 + i] = softmax_row(row, n, len); });
    gemm(false, false, rows, D, keys, 1.0f, s, keys, v.p + k0 * v.ld, v.ld, 0.0f, o.p + r0 * o.ld, o.ld);
  }
}

void backward_head(Head q, Head k, Head v, Head o, Head dout, const float* lse, Head dq, Head dk, Head dv,
                   int64_t T, int64_t D, float scale, Starts st) {
  const BlasOnThisThread one_thread;
  float* buf = scratch(size_t(2 * kBlockRows * T + T)).data();
  float *p = buf, *dp = buf + kBlockRows * T, *delta = buf + 2 * kBlockRows * T;
  for (int64_t i = 0; i < T; ++i) delta[i] = loops::dot(dout.p + i * dout.ld, o.p + i * o.ld, D);
  const int64_t blocks = (T + kBlockRows - 1) / kBlockRows;
  if (st.p) {
    // Packed: the last block need not see every key, so dK and dV start from zeros.
    for (int64_t i = 0; i < T; ++i) {
      std::fill(dk.p + i * dk.ld, dk.p + i * dk.ld + D, 0.0f);
      std::fill(dv.p + i * dv.ld, dv.p + i * dv.ld + D, 0.0f);
    }
  }
  for (int64_t b = blocks - 1; b >= 0; --b) {
    const int64_t r0 = b * kBlockRows, r1 = std::min(T, r0 + kBlockRows), rows = r1 - r0;
    const int64_t k0 = st.first(r0, r1), keys = r1 - k0;
    // The last block sees every key: it starts dK and dV (unless packed, above).
    const float beta = b == blocks - 1 && !st.p ? 0.0f : 1.0f;
    const float *qb = q.p + r0 * q.ld, *gb = dout.p + r0 * dout.ld, *kb = k.p + k0 * k.ld,
                *vb = v.p + k0 * v.ld;
    gemm(false, true, rows, keys, D, scale, qb, q.ld, kb, k.ld, 0.0f, p, keys);
    for (int64_t i = 0; i < rows; ++i)
      visible_row(p + i * keys, st.of(r0 + i) - k0, r0 + i + 1 - k0, keys,
                  [&](float* row, int64_t n, int64_t len) { probs_row(row, lse[r0 + i], n, len); });
    gemm(true, false, keys, D, rows, 1.0f, p, keys, gb, dout.ld, beta, dv.p + k0 * dv.ld, dv.ld);
    gemm(false, true, rows, keys, D, 1.0f, gb, dout.ld, vb, v.ld, 0.0f, dp, keys);
    for (int64_t i = 0; i < rows; ++i) dscores_row(p + i * keys, dp + i * keys, delta[r0 + i], scale, keys);
    gemm(false, false, rows, D, keys, 1.0f, dp, keys, kb, k.ld, 0.0f, dq.p + r0 * dq.ld, dq.ld);
    gemm(true, false, keys, D, rows, 1.0f, dp, keys, qb, q.ld, beta, dk.p + k0 * dk.ld, dk.ld);
  }
}

// Rows of D floats one after another, a leading dimension the BLAS's int holds (the kernel reads
// rows through it).
at::Tensor rows_dense(const at::Tensor& x) {
  return x.stride(3) == 1 && x.stride(2) <= std::numeric_limits<int>::max() ? x : x.contiguous();
}

// Sample b's rows of `starts` (int64 [B, T], contiguous; empty: none).
Starts starts_of(const at::Tensor& starts, int64_t b) {
  return {starts.numel() > 0 ? starts.const_data_ptr<int64_t>() + b * starts.size(1) : nullptr};
}

struct CausalAttention : torch::autograd::Function<CausalAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in,
                            const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& starts) {
    const auto q = rows_dense(q_in), k = rows_dense(k_in), v = rows_dense(v_in);
    const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
    const float scale = 1.0f / std::sqrt(float(D));
    auto o = like_heads(q);
    auto lse = at::empty({B, H, T}, q.options());
    float* lp = lse.mutable_data_ptr<float>();
    parallel_ranges(B * H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t bh = h0; bh < h1; ++bh)
        forward_head(head(q, bh), head(k, bh), head(v, bh), head(o, bh), lp + bh * T, T, D, scale,
                     starts_of(starts, bh / H));
    });
    ctx->save_for_backward({q, k, v, o, lse, starts});
    return o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4],
               &starts = saved[5];
    if (!grads[0].defined()) return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v), at::Tensor()};
    const auto dout = rows_dense(grads[0]);
    const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
    const float scale = 1.0f / std::sqrt(float(D));
    auto dq = like_heads(q), dk = like_heads(k), dv = like_heads(v);
    const float* lp = lse.const_data_ptr<float>();
    parallel_ranges(B * H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t bh = h0; bh < h1; ++bh)
        backward_head(head(q, bh), head(k, bh), head(v, bh), head(o, bh), head(dout, bh), lp + bh * T,
                      head(dq, bh), head(dk, bh), head(dv, bh), T, D, scale, starts_of(starts, bh / H));
    });
    return {dq, dk, dv, at::Tensor()};
  }
};

// One head of the attention's projection qkv [B, T, 3, H, D]: part 0 (q), 1 (k) or 2 (v) of pair
// bh = b H + h, rows a position apart.
Head qkv_head(const at::Tensor& qkv, int64_t bh, int64_t part) {
  const int64_t H = qkv.size(3);
  return {const_cast<float*>(qkv.const_data_ptr<float>()) + (bh / H) * qkv.stride(0) + part * qkv.stride(2) +
              (bh % H) * qkv.stride(3),
          qkv.stride(1)};
}

// Head bh's q and k rows of the projection, rotated into q and k by the tables cos and sin ([T, D],
// or [B, T, D]: a table per sample).
void rotate_qk(const at::Tensor& qkv, int64_t bh, Head q, Head k, const at::Tensor& cos_t,
               const at::Tensor& sin_t) {
  const int64_t T = qkv.size(1), H = qkv.size(3), D = qkv.size(4);
  const int64_t off = cos_t.dim() == 3 ? (bh / H) * T * D : 0;
  const float *cos = cos_t.const_data_ptr<float>() + off, *sin = sin_t.const_data_ptr<float>() + off;
  const Head qs = qkv_head(qkv, bh, 0), ks = qkv_head(qkv, bh, 1);
  detail::rotate_head(q.p, q.ld, qs.p, qs.ld, cos, sin, T, D, false);
  detail::rotate_head(k.p, k.ld, ks.p, ks.ld, cos, sin, T, D, false);
}

// rotary_qkv and causal_attention in one pass per head. Forward, each head's q and k rows are
// rotated into the thread's scratch (T x D each, kept in its cache) and v is read where the
// projection left it; backward rotates them again and writes the projection's gradient itself: dv
// by the products, dq and dk from the scratch through the rotation's gradient. No [B, H, T, D]
// tensor of q, k, v or their gradients is written, and the projection is what is saved.
struct RotaryCausalAttention : torch::autograd::Function<RotaryCausalAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& starts) {
    const int64_t B = qkv.size(0), T = qkv.size(1), H = qkv.size(3), D = qkv.size(4);
    const float scale = 1.0f / std::sqrt(float(D));
    auto o = at::empty({B, T, H, D}, qkv.options()).permute({0, 2, 1, 3});
    auto lse = at::empty({B, H, T}, qkv.options());
    float* lp = lse.mutable_data_ptr<float>();
    parallel_ranges(B * H, 1, [&](int64_t h0, int64_t h1) {
      float* rows = scratch(size_t(2 * T * D), 1).data();
      const Head q{rows, D}, k{rows + T * D, D};
      for (int64_t bh = h0; bh < h1; ++bh) {
        rotate_qk(qkv, bh, q, k, cos, sin);
        forward_head(q, k, qkv_head(qkv, bh, 2), head(o, bh), lp + bh * T, T, D, scale,
                     starts_of(starts, bh / H));
      }
    });
    ctx->save_for_backward({qkv, cos, sin, o, lse, starts});
    return o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &qkv = saved[0], &cos = saved[1], &sin = saved[2], &o = saved[3], &lse = saved[4],
               &starts = saved[5];
    if (!grads[0].defined()) return {at::zeros_like(qkv), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto dout = rows_dense(grads[0]);
    const int64_t B = qkv.size(0), T = qkv.size(1), H = qkv.size(3), D = qkv.size(4);
    const float scale = 1.0f / std::sqrt(float(D));
    auto g = at::empty_like(qkv, at::MemoryFormat::Contiguous);
    const float* lp = lse.const_data_ptr<float>();
    const int64_t off = cos.dim() == 3 ? T * D : 0;  // between two samples' tables
    const float *cp = cos.const_data_ptr<float>(), *sp = sin.const_data_ptr<float>();
    parallel_ranges(B * H, 1, [&](int64_t h0, int64_t h1) {
      float* rows = scratch(size_t(4 * T * D), 1).data();
      const Head q{rows, D}, k{rows + T * D, D}, dq{rows + 2 * T * D, D}, dk{rows + 3 * T * D, D};
      for (int64_t bh = h0; bh < h1; ++bh) {
        rotate_qk(qkv, bh, q, k, cos, sin);
        backward_head(q, k, qkv_head(qkv, bh, 2), head(o, bh), head(dout, bh), lp + bh * T, dq, dk,
                      qkv_head(g, bh, 2), T, D, scale, starts_of(starts, bh / H));
        const Head gq = qkv_head(g, bh, 0), gk = qkv_head(g, bh, 1);
        const float *c = cp + (bh / H) * off, *sn = sp + (bh / H) * off;
        detail::rotate_head(gq.p, gq.ld, dq.p, dq.ld, c, sn, T, D, true);
        detail::rotate_head(gk.p, gk.ld, dk.p, dk.ld, c, sn, T, D, true);
      }
    });
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// `starts` checked and made the kernels' (CPU, int64, contiguous); undefined becomes empty (an
// autograd function's inputs are defined tensors).
at::Tensor checked_starts(const at::Tensor& starts, int64_t B, int64_t T, const at::Tensor& like) {
  if (!starts.defined()) return at::empty({0}, like.options().dtype(at::kLong));
  TORCH_CHECK(
      starts.dim() == 2 && starts.size(0) == B && starts.size(1) == T && starts.scalar_type() == at::kLong,
      "causal attention: starts must be int64 [", B, ", ", T, "], got ", starts.scalar_type(), " ",
      starts.sizes());
  return starts.to(at::kCPU).contiguous();
}

// Whether every start is a key its row sees: 0 <= starts[b, i] <= i (read on the host; the kernels'
// own path only).
void check_start_range(const at::Tensor& starts) {
  if (starts.numel() == 0) return;
  const int64_t B = starts.size(0), T = starts.size(1);
  const int64_t* p = starts.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i)
      TORCH_CHECK(p[b * T + i] >= 0 && p[b * T + i] <= i, "causal attention: sample ", b, " row ", i,
                  " starts at key ", p[b * T + i], ", outside 0..", i, " (positions past the row's index?)");
}

}  // namespace

bool causal_attention_available() { return detail::blas_available(); }

at::Tensor causal_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& starts) {
  if (!starts.defined())
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
  // Key j visible from query i of sample b: starts[b, i] <= j <= i.
  const auto T = q.size(2);
  const auto keys = at::arange(T, starts.options().device(q.device()));
  const auto st = starts.to(q.device()).unsqueeze(-1);  // [B, T, 1]
  const auto mask = (keys.view({1, 1, T}) >= st) & (keys.view({1, 1, T}) <= keys.view({1, T, 1}));
  return at::scaled_dot_product_attention(q, k, v, mask.unsqueeze(1), /*dropout_p=*/0.0, /*is_causal=*/false);
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& starts_in) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "causal_attention: expected q, k and v of one shape [B, H, T, D], got ", q.sizes(), ", ",
              k.sizes(), " and ", v.sizes());
  const bool own = q.is_cpu() && k.is_cpu() && v.is_cpu() && q.scalar_type() == at::kFloat &&
                   k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && q.numel() > 0 &&
                   q.size(2) <= std::numeric_limits<int>::max() / kBlockRows && causal_attention_available();
  if (!own) return causal_attention_reference(q, k, v, starts_in);
  const auto starts = checked_starts(starts_in, q.size(0), q.size(2), q);
  check_start_range(starts);
  return CausalAttention::apply(q, k, v, starts);
}

at::Tensor rotary_causal_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& starts_in) {
  detail::check_rotary_shapes(qkv, cos, sin);
  if (qkv.is_cpu() && at::isReducedFloatingType(qkv.scalar_type()) &&
      qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type() &&
      causal_attention_available()) {
    // 16-bit: the kernel on the values widened to float32, the result rounded once (Note [16-bit
    // attention on the CPU]).
    const auto wide = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
    return rotary_causal_attention(wide(qkv), wide(cos), wide(sin), starts_in).to(qkv.scalar_type());
  }
  const bool own = qkv.is_cpu() && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() &&
                   qkv.numel() > 0 && qkv.size(1) <= std::numeric_limits<int>::max() / kBlockRows &&
                   qkv.stride(1) <= std::numeric_limits<int>::max() && cos.scalar_type() == at::kFloat &&
                   sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                   !cos.requires_grad() && !sin.requires_grad() && causal_attention_available();
  if (!own) {
    const auto [q, k, v] = rotary_qkv(qkv, cos, sin);
    return causal_attention(q, k, v, starts_in);
  }
  const auto starts = checked_starts(starts_in, qkv.size(0), qkv.size(1), qkv);
  check_start_range(starts);
  return RotaryCausalAttention::apply(qkv, cos, sin, starts);
}

}  // namespace fsdpp::models
