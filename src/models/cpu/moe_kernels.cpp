// The MoE layer's kernels (kernels.hpp): the router's softmax and top-k, and dropless routing's
// rows to and from the experts (the sort by expert, the gather of each assignment's row and the
// weighted sum back to the tokens), forward and backward.
//
// Built with -ffp-contract=off: every product and sum is rounded on its own, as ATen's
// elementwise kernels and index_add round them, which the rows' bitwise agreement with the
// reference rests on.
#include "fsdpp/models/cpu/kernels.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdpp/base/parallel.hpp"
#include "float_loops.hpp"

namespace fsdpp::models {

namespace {

using loops::exp_poly;
using loops::rows_per_task;

// Token t's k positions, ascending: the order in which index_add adds its rows.
void positions_of(const int64_t* position, int64_t t, int64_t k, int64_t* out) {
  std::copy(position + t * k, position + (t + 1) * k, out);
  std::sort(out, out + k);
}

// out[d] = ((0 + r(p_0)[d]) + r(p_1)[d]) + ... over the token's positions p, ascending, where
// r(p)[d] = src[p * D + d] * scale(p) (scale 1: no multiply).
template <bool Scaled, typename Scale>
void sum_rows(const float* src, const int64_t* ps, int64_t k, int64_t D, Scale scale, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const float* row = src + ps[j] * D;
    if constexpr (Scaled) {
      const float s = scale(ps[j]);
      for (int64_t d = 0; d < D; ++d) out[d] += row[d] * s;
    } else {
      for (int64_t d = 0; d < D; ++d) out[d] += row[d];
    }
  }
}

bool fusable(const at::Tensor& t, const ExpertOrder& o) {
  return t.is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && o.position.defined();
}

// One token's router row: scores = softmax(l) over E, its logsumexp, and the k highest scores
// (scanning from expert 0, so the lower index wins a tie), their weights normalised when asked.
float router_row(const float* l, int64_t E, int64_t k, bool normalize, float* scores, int64_t* experts,
                 float* weights) {
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = l[e] > m ? l[e] : m;
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    scores[e] = exp_poly(l[e] - m);
    sum += scores[e];
  }
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < E; ++e) scores[e] *= inv;
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || experts[i] == e;
      if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
    }
    experts[j] = best;
    weights[j] = scores[best];
    total += weights[j];
  }
  if (normalize)
    for (int64_t j = 0; j < k; ++j) weights[j] /= total;
  return m + std::log(sum);
}

struct SoftmaxTopK : torch::autograd::Function<SoftmaxTopK> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& logits_in, int64_t k, bool normalize) {
    const auto logits = logits_in.contiguous();
    const int64_t T = logits.size(0), E = logits.size(1);
    auto scores = at::empty_like(logits), lse = at::empty({T}, logits.options());
    auto weights = at::empty({T, k}, logits.options()),
         experts = at::empty({T, k}, logits.options().dtype(at::kLong));
    const float* lp = logits.const_data_ptr<float>();
    float *sp = scores.mutable_data_ptr<float>(), *zp = lse.mutable_data_ptr<float>(),
          *wp = weights.mutable_data_ptr<float>();
    int64_t* ep = experts.mutable_data_ptr<int64_t>();
    parallel_ranges(T, rows_per_task(E * k), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        zp[t] = router_row(lp + t * E, E, k, normalize, sp + t * E, ep + t * k, wp + t * k);
    });
    ctx->mark_non_differentiable({experts});
    ctx->set_materialize_grads(false);
    ctx->saved_data["normalize"] = normalize;
    ctx->save_for_backward({scores, weights, experts});
    return {scores, lse, weights, experts};
  }

  // d logits = s * (gs - sum(gs * s)) + g_lse * s, where gs is the scores' gradient plus what the
  // weights' pass to the chosen scores: g_w, or (g_w - sum_j g_w w_j) / Z with Z the chosen scores'
  // sum when normalised.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &scores = saved[0], &weights = saved[1], &experts = saved[2];
    const bool normalize = ctx->saved_data["normalize"].toBool();
    const int64_t T = scores.size(0), E = scores.size(1), k = weights.size(1);
    const auto gs = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    const auto gz = grads[1].defined() ? grads[1].contiguous() : at::Tensor();
    const auto gw = grads[2].defined() ? grads[2].contiguous() : at::Tensor();
    auto dl = at::empty_like(scores);
    const float *sp = scores.const_data_ptr<float>(), *wp = weights.const_data_ptr<float>();
    const float* gsp = gs.defined() ? gs.const_data_ptr<float>() : nullptr;
    const float* gzp = gz.defined() ? gz.const_data_ptr<float>() : nullptr;
    const float* gwp = gw.defined() ? gw.const_data_ptr<float>() : nullptr;
    const int64_t* ep = experts.const_data_ptr<int64_t>();
    float* dp = dl.mutable_data_ptr<float>();
    parallel_ranges(T, rows_per_task(E * k), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* s = sp + t * E;
        float* d = dp + t * E;  // holds gs, then d logits
        for (int64_t e = 0; e < E; ++e) d[e] = gsp ? gsp[t * E + e] : 0.0f;
        if (gwp) {
          const float* g = gwp + t * k;
          const int64_t* chosen = ep + t * k;
          if (normalize) {
            float total = 0.0f, dot = 0.0f;
            for (int64_t j = 0; j < k; ++j) total += s[chosen[j]];
            for (int64_t j = 0; j < k; ++j) dot += g[j] * wp[t * k + j];
            for (int64_t j = 0; j < k; ++j) d[chosen[j]] += (g[j] - dot) / total;
          } else {
            for (int64_t j = 0; j < k; ++j) d[chosen[j]] += g[j];
          }
        }
        float inner = 0.0f;
        for (int64_t e = 0; e < E; ++e) inner += d[e] * s[e];
        const float z = gzp ? gzp[t] : 0.0f;
        for (int64_t e = 0; e < E; ++e) d[e] = s[e] * (d[e] - inner) + z * s[e];
      }
    });
    return {dl, at::Tensor(), at::Tensor()};
  }
};

struct DispatchRows : torch::autograd::Function<DispatchRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in,
                            const at::Tensor& order, const at::Tensor& position, int64_t k) {
    const auto x = x_in.contiguous();
    const int64_t n = order.numel(), D = x.size(1);
    auto rows = at::empty({n, D}, x.options());
    const float* xp = x.const_data_ptr<float>();
    float* rp = rows.mutable_data_ptr<float>();
    const int64_t* op = order.const_data_ptr<int64_t>();
    parallel_ranges(n, rows_per_task(D), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) std::memcpy(rp + p * D, xp + op[p] / k * D, D * sizeof(float));
    });
    ctx->saved_data["k"] = k;
    ctx->save_for_backward({position});
    return rows;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto position = ctx->get_saved_variables()[0];
    const int64_t k = ctx->saved_data["k"].toInt(), T = position.numel() / k;
    const auto g = grads[0].contiguous();
    const int64_t D = g.size(1);
    auto dx = at::empty({T, D}, g.options());
    const float* gp = g.const_data_ptr<float>();
    float* dp = dx.mutable_data_ptr<float>();
    const int64_t* pos = position.const_data_ptr<int64_t>();
    parallel_ranges(T, rows_per_task(k * D), [&](int64_t t0, int64_t t1) {
      std::vector<int64_t> ps(static_cast<size_t>(k));
      for (int64_t t = t0; t < t1; ++t) {
        positions_of(pos, t, k, ps.data());
        sum_rows<false>(gp, ps.data(), k, D, 0, dp + t * D);
      }
    });
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct CombineRows : torch::autograd::Function<CombineRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y_in,
                            const at::Tensor& w_in, const at::Tensor& order, const at::Tensor& position) {
    const auto y = y_in.contiguous(), w = w_in.contiguous();
    const int64_t T = w.size(0), k = w.size(1), D = y.size(1);
    auto out = at::empty({T, D}, y.options());
    const float *yp = y.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
    float* outp = out.mutable_data_ptr<float>();
    const int64_t *op = order.const_data_ptr<int64_t>(), *pos = position.const_data_ptr<int64_t>();
    parallel_ranges(T, rows_per_task(k * D), [&](int64_t t0, int64_t t1) {
      std::vector<int64_t> ps(static_cast<size_t>(k));
      for (int64_t t = t0; t < t1; ++t) {
        positions_of(pos, t, k, ps.data());
        sum_rows<true>(
            yp, ps.data(), k, D, [&](int64_t p) { return wp[op[p]]; }, outp + t * D);
      }
    });
    ctx->save_for_backward({y, w, position});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &y = saved[0], &w = saved[1], &position = saved[2];
    const int64_t T = w.size(0), k = w.size(1), D = y.size(1);
    const auto g = grads[0].contiguous();
    const bool want_y = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    at::Tensor dy = want_y ? at::empty_like(y) : at::Tensor(), dw = want_w ? at::empty_like(w) : at::Tensor();
    const float *yp = y.const_data_ptr<float>(), *wp = w.const_data_ptr<float>(),
                *gp = g.const_data_ptr<float>();
    float* dyp = want_y ? dy.mutable_data_ptr<float>() : nullptr;
    float* dwp = want_w ? dw.mutable_data_ptr<float>() : nullptr;
    const int64_t* pos = position.const_data_ptr<int64_t>();
    // Token by token: its gradient row is read once for its k rows of y's gradient (g[t] w[t, j],
    // the reference's product) and its k weights' gradients (g[t] . y[p]).
    parallel_ranges(T, rows_per_task(k * D), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* gt = gp + t * D;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t a = t * k + j, p = pos[a];
          if (want_y) {
            const float s = wp[a];
            float* row = dyp + p * D;
            for (int64_t d = 0; d < D; ++d) row[d] = gt[d] * s;
          }
          if (want_w) dwp[a] = loops::dot(gt, yp + p * D, D);
        }
      }
    });
    return {dy, dw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

RouterTopK softmax_top_k_reference(const at::Tensor& logits, int64_t k, bool normalize) {
  RouterTopK r;
  r.scores = at::softmax(logits, -1);
  auto [w, idx] = at::topk(r.scores, k, -1);
  r.weights = normalize ? w / w.sum(-1, /*keepdim=*/true) : w;
  r.experts = idx;
  r.lse = at::logsumexp(logits, -1);
  return r;
}

RouterTopK softmax_top_k(const at::Tensor& logits, int64_t k, bool normalize) {
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1), "softmax_top_k: top ", k, " of logits ",
              logits.sizes(), "; logits must be [tokens, experts] with 1 <= k <= experts");
  if (!logits.is_cpu() || logits.scalar_type() != at::kFloat)
    return softmax_top_k_reference(logits, k, normalize);
  const auto out = SoftmaxTopK::apply(logits, k, normalize);
  return {out[0], out[1], out[2], out[3]};
}

ExpertOrder sort_by_expert(const at::Tensor& experts, int64_t num_experts) {
  TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == at::kLong,
              "sort_by_expert: experts must be an int64 [tokens, top_k] tensor, got ", experts.scalar_type(),
              " ", experts.sizes());
  TORCH_CHECK(num_experts > 0, "sort_by_expert: num_experts must be positive, got ", num_experts);
  ExpertOrder o;
  o.top_k = experts.size(1);
  const auto flat = experts.reshape(-1);
  if (!experts.is_cpu()) {
    o.order = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
    // A scatter rather than bincount, which reads the largest index on the host (no capture).
    o.counts = at::zeros({num_experts}, flat.options()).scatter_add_(0, flat, at::ones_like(flat));
    return o;
  }
  const auto e = flat.contiguous();
  const int64_t n = e.numel();
  const int64_t* ep = e.const_data_ptr<int64_t>();
  o.counts = at::zeros({num_experts}, e.options());
  o.order = at::empty({n}, e.options());
  o.position = at::empty({n}, e.options());
  int64_t* cp = o.counts.mutable_data_ptr<int64_t>();
  for (int64_t a = 0; a < n; ++a) {
    if (ep[a] < 0 || ep[a] >= num_experts)
      throw std::out_of_range(
          fmt::format("sort_by_expert: token {}'s choice {} is expert {}, outside [0, {})", a / o.top_k,
                      a % o.top_k, ep[a], num_experts));
    ++cp[ep[a]];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_experts));
  for (int64_t x = 1; x < num_experts; ++x) next[x] = next[x - 1] + cp[x - 1];
  int64_t *op = o.order.mutable_data_ptr<int64_t>(), *pp = o.position.mutable_data_ptr<int64_t>();
  for (int64_t a = 0; a < n; ++a) {
    const int64_t p = next[ep[a]]++;
    op[p] = a;
    pp[a] = p;
  }
  return o;
}

at::Tensor dispatch_rows_reference(const at::Tensor& x, const ExpertOrder& o) {
  return x.index_select(0, at::floor_divide(o.order, o.top_k));
}

at::Tensor dispatch_rows(const at::Tensor& x, const ExpertOrder& o) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) * o.top_k == o.order.numel(), "dispatch_rows: x ", x.sizes(),
              " does not hold the ", o.order.numel() / o.top_k, " tokens of the order");
  if (!fusable(x, o)) return dispatch_rows_reference(x, o);
  return DispatchRows::apply(x, o.order, o.position, o.top_k);
}

at::Tensor combine_rows_reference(const at::Tensor& y, const at::Tensor& weights, const ExpertOrder& o) {
  const auto tok = at::floor_divide(o.order, o.top_k);
  const auto weighted = y * weights.reshape(-1).index_select(0, o.order).unsqueeze(1);
  return at::zeros({weights.size(0), y.size(1)}, y.options()).index_add(0, tok, weighted);
}

at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& weights, const ExpertOrder& o) {
  TORCH_CHECK(y.dim() == 2 && y.size(0) == o.order.numel() && weights.dim() == 2 &&
                  weights.size(1) == o.top_k && weights.numel() == o.order.numel(),
              "combine_rows: y ", y.sizes(), " and weights ", weights.sizes(), " do not match the order of ",
              o.order.numel(), " assignments, top-", o.top_k);
  if (!fusable(y, o) || !weights.is_cpu() || weights.scalar_type() != at::kFloat)
    return combine_rows_reference(y, weights, o);
  return CombineRows::apply(y, weights, o.order, o.position);
}

}  // namespace fsdpp::models
