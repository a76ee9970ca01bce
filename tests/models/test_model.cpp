// The MoE model: routing (top-k, capacity, dropped tokens), auxiliary losses against hand-computed
// values, dispatch against a per-token loop, the auxiliary-loss gradient path, causality, stages.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <doctest/doctest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cfenv>
#include <cmath>
#include <functional>
#include <utility>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "fsdpp/base/adopt.hpp"
#include "fsdpp/models/cpu/kernels.hpp"
#include "fsdpp/models/cpu/matmul.hpp"
#include "fsdpp/models/moe.hpp"

using namespace fsdpp;
using models::MoEConfig;

namespace {

MoEConfig small_config() {
  MoEConfig c;
  c.dim = 16;
  c.heads = 2;
  c.layers = 2;
  c.max_seq_len = 32;
  c.ffn_hidden = 24;
  c.experts = 4;
  c.top_k = 2;
  c.expert_hidden = 12;
  return c;
}

// softmax(q k^T / sqrt(d) + causal mask) v in float64, the scores written out.
at::Tensor attention_f64(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = q.size(2);
  const auto qd = q.to(at::kDouble), kd = k.to(at::kDouble), vd = v.to(at::kDouble);
  auto s = at::matmul(qd, kd.transpose(-2, -1)) / std::sqrt(double(q.size(3)));
  s = s.masked_fill(at::ones({T, T}, at::kBool).triu(1), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1), vd);
}

double softmax_at(std::vector<double> l, size_t i) {
  double m = *std::max_element(l.begin(), l.end()), s = 0;
  for (double v : l) s += std::exp(v - m);
  return std::exp(l[i] - m) / s;
}

}  // namespace

TEST_CASE("router: load-balancing and z-loss match a hand computation") {
  // Two experts, top-1, the gate is the identity, so the logits are the inputs themselves.
  MoEConfig c;
  c.dim = 2;
  c.experts = 2;
  c.top_k = 1;
  auto moe = models::MoE(c, std::make_shared<models::RouterStats>());
  {
    at::NoGradGuard g;
    moe->router->gate->weight.copy_(at::eye(2));
  }
  const std::vector<std::vector<double>> logits = {{2, 0}, {1, 0}, {0, 1}, {3, 0}};
  const auto x = at::tensor({2.f, 0.f, 1.f, 0.f, 0.f, 1.f, 3.f, 0.f}).view({4, 2});
  const auto r = moe->route(x);
  // Choices: experts 0, 0, 1, 0, so f = (3/4, 1/4); P_e = mean softmax probability of e.
  CHECK(r.experts.view(-1).equal(at::tensor({0L, 0L, 1L, 0L})));
  double p0 = 0, p1 = 0, z = 0;
  for (const auto& l : logits) {
    p0 += softmax_at(l, 0) / 4, p1 += softmax_at(l, 1) / 4;
    const double lse = std::log(std::exp(l[0]) + std::exp(l[1]));
    z += lse * lse / 4;
  }
  const double aux = 2 * (0.75 * p0 + 0.25 * p1);
  CHECK(r.aux_loss.item<double>() == doctest::Approx(aux).epsilon(1e-6));
  CHECK(r.z_loss.item<double>() == doctest::Approx(z).epsilon(1e-6));
  // Top-1 with softmax keeps the probability itself as the combine weight.
  CHECK(r.weights[0].item<double>() == doctest::Approx(softmax_at(logits[0], 0)).epsilon(1e-6));
}

TEST_CASE("router: top-k picks the highest scores; weights sum to one; sigmoid scores too") {
  for (const char* score : {"softmax", "sigmoid"}) {
    CAPTURE(score);
    auto c = small_config();
    c.score = score;
    auto moe = models::MoE(c, std::make_shared<models::RouterStats>());
    const auto x = at::randn({20, c.dim});
    const auto r = moe->route(x);
    const auto sorted = std::get<0>(r.scores.sort(-1, /*descending=*/true));
    CHECK(r.scores.gather(1, r.experts).allclose(sorted.narrow(1, 0, c.top_k)));
    CHECK(r.weights.sum(-1).allclose(at::ones({20})));
    CHECK(r.experts.select(1, 0).ne(r.experts.select(1, 1)).all().item<bool>());
  }
}

TEST_CASE("MoE dropless: equals a per-token loop over the chosen experts") {
  auto c = small_config();
  c.shared_expert = true;
  auto moe = models::MoE(c, std::make_shared<models::RouterStats>());
  const auto x = at::randn({3, 5, c.dim});
  at::NoGradGuard g;
  const auto y = moe->forward(x);
  const auto flat = x.view({-1, c.dim});
  const auto r = moe->route(flat);
  auto& E = *moe->experts;
  for (int64_t t = 0; t < flat.size(0); ++t) {
    const auto xt = flat[t];
    auto want = moe->shared->forward(xt.unsqueeze(0)).squeeze(0);
    for (int64_t k = 0; k < c.top_k; ++k) {
      const auto e = r.experts[t][k].item<int64_t>();
      const auto h = at::silu(at::mv(E.w1[e], xt)) * at::mv(E.w3[e], xt);
      want = want + r.weights[t][k] * at::mv(E.w2[e], h);
    }
    CHECK(y.view({-1, c.dim})[t].allclose(want, 1e-5, 1e-6));
  }
  CHECK(moe->stats->read().assignments == flat.size(0) * c.top_k);
  CHECK(moe->stats->read().dropped == 0);
}

TEST_CASE("MoE capacity: with room for every assignment it equals dropless, values and gradients") {
  auto c = small_config();
  auto dropless = models::MoE(c, std::make_shared<models::RouterStats>());
  c.routing = "capacity";
  c.capacity_factor = double(c.experts);  // C = T * k: nothing can drop
  auto capacity = models::MoE(c, std::make_shared<models::RouterStats>());
  {
    at::NoGradGuard g;
    for (auto& p : capacity->named_parameters()) p.value().copy_(dropless->named_parameters()[p.key()]);
  }
  const auto x = at::randn({4, 6, c.dim});
  auto y1 = dropless->forward(x), y2 = capacity->forward(x);
  CHECK(y1.allclose(y2, 1e-5, 1e-6));
  (y1 * y1).sum().backward();
  (y2 * y2).sum().backward();
  for (auto& p : dropless->named_parameters()) {
    CAPTURE(p.key());
    CHECK(p.value().grad().allclose(capacity->named_parameters()[p.key()].grad(), 1e-4, 1e-6));
  }
  CHECK(capacity->stats->read().dropped == 0);
}

TEST_CASE("MoE capacity: overflowing assignments are dropped in token order and counted") {
  MoEConfig c = small_config();
  c.routing = "capacity";
  c.top_k = 1;
  c.capacity_factor = 1.0;
  auto moe = models::MoE(c, std::make_shared<models::RouterStats>());
  {
    at::NoGradGuard g;
    moe->router->gate->weight.fill_(-1);
    moe->router->gate->weight[2].fill_(1);  // every token prefers expert 2
  }
  const int64_t T = 8;
  const auto x = at::rand({T, c.dim}) + 0.5;  // positive, so expert 2 wins for all
  at::NoGradGuard g;
  const auto y = moe->forward(x);
  const int64_t C = 2;  // ceil(1.0 * 8 * 1 / 4)
  CHECK(moe->stats->read().dropped == T - C);
  CHECK(moe->stats->dropped_fraction() == doctest::Approx(double(T - C) / T));
  for (int64_t t = 0; t < T; ++t) {
    CAPTURE(t);
    CHECK((y[t].abs().sum().item<double>() > 0) == (t < C));  // the first C tokens got the slots
  }
}

TEST_CASE("MoE: the auxiliary losses reach the gradients as if added to the loss") {
  auto c = small_config();
  c.aux_loss_coef = 0.5;  // large, so that the check would notice a missing term
  c.z_loss_coef = 0.1;
  auto with_aux = models::MoE(c, std::make_shared<models::RouterStats>());
  with_aux->stats->aux_grad_scale = 0.25;
  auto plain_cfg = c;
  plain_cfg.aux_loss_coef = plain_cfg.z_loss_coef = 0;
  auto plain = models::MoE(plain_cfg, std::make_shared<models::RouterStats>());
  {
    at::NoGradGuard g;
    for (auto& p : plain->named_parameters()) p.value().copy_(with_aux->named_parameters()[p.key()]);
  }
  const auto x = at::randn({10, c.dim});
  (with_aux->forward(x).sum() * 0.25).backward();
  const auto r = plain->route(x);
  ((plain->forward(x).sum() + c.aux_loss_coef * r.aux_loss + c.z_loss_coef * r.z_loss) * 0.25).backward();
  const auto& g1 = with_aux->router->gate->weight.grad();
  const auto& g2 = plain->router->gate->weight.grad();
  CHECK(g1.allclose(g2, 1e-5, 1e-7));
  // And the term matters: without it the gate gradient differs.
  auto none = models::MoE(plain_cfg, std::make_shared<models::RouterStats>());
  {
    at::NoGradGuard g;
    for (auto& p : none->named_parameters()) p.value().copy_(with_aux->named_parameters()[p.key()]);
  }
  (none->forward(x).sum() * 0.25).backward();
  CHECK_FALSE(none->router->gate->weight.grad().allclose(g1, 1e-5, 1e-7));
}

TEST_CASE("model: causal (a later byte never changes earlier logits), stages compose to the full model") {
  auto c = small_config();
  auto model = models::MoETransformer(c);
  at::NoGradGuard g;
  auto tokens = at::randint(256, {2, 12});
  const auto a = model->forward(tokens);
  CHECK(a.sizes() == at::IntArrayRef({2, 12, 256}));
  auto changed = tokens.clone();
  changed.select(1, 7).fill_(3);
  const auto b = model->forward(changed);
  CHECK(a.narrow(1, 0, 7).allclose(b.narrow(1, 0, 7), 1e-5, 1e-6));
  CHECK_FALSE(a.narrow(1, 7, 5).allclose(b.narrow(1, 7, 5), 1e-5, 1e-6));

  auto first = models::MoETransformer(std::make_shared<models::MoETransformerImpl>(*model, 0, 1));
  auto second = models::MoETransformer(std::make_shared<models::MoETransformerImpl>(*model, 1, 2));
  CHECK(second->forward(first->forward(tokens)).equal(a));
  // Stage parameters keep the full model's names.
  CHECK(first->named_parameters().contains("layers.0.attn.qkv.weight"));
  CHECK(second->named_parameters().contains("layers.1.moe.router.gate.weight"));
  CHECK(second->named_parameters().contains("head.weight"));
  CHECK_FALSE(second->named_parameters().contains("embed.weight"));
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  CHECK(n == c.parameter_count());
}

namespace {

// A wrapper that counts its calls, as an FSDP unit or a checkpointing wrapper would stand in.
struct CountingImpl : torch::nn::Module {
  CountingImpl(models::Block block, int* calls) : inner(std::move(block)), calls(calls) {
    adopt_members(*this, *inner);
  }
  at::Tensor forward(at::Tensor x, at::Tensor positions) {
    ++*calls;
    return inner->forward(std::move(x), std::move(positions));
  }
  models::Block inner;
  int* calls;
};

}  // namespace

TEST_CASE("model: wrap_blocks puts a wrapper where each block was, keeping names and results") {
  auto model = models::MoETransformer(small_config());
  at::NoGradGuard g;
  const auto tokens = at::randint(256, {2, 12});
  const auto before = model->forward(tokens);
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  int calls = 0;
  model->wrap_blocks([&](const models::Block& b, int64_t) {
    return torch::nn::AnyModule(std::make_shared<CountingImpl>(b, &calls));
  });
  CHECK(model->forward(tokens).equal(before));
  CHECK(calls == small_config().layers);  // forward went through every wrapper
  std::vector<std::string> after;
  for (const auto& p : model->named_parameters()) after.push_back(p.key());
  CHECK(after == names);
  CHECK(model->blocks().size() == size_t(small_config().layers));  // the blocks themselves, still reachable
  // A stage is cut from the unwrapped model only.
  CHECK_THROWS_WITH(models::MoETransformerImpl(*model, 0, 1), doctest::Contains("not wrapped"));
}

TEST_CASE("lm_loss: uniform logits give ln(vocab)") {
  const auto logits = at::zeros({2, 5, 256});
  const auto targets = at::randint(256, {2, 5});
  CHECK(models::lm_loss(logits, targets).item<double>() == doctest::Approx(std::log(256.0)));
}

TEST_CASE("rotary_qkv: the fused CPU kernel gives the ATen composition's bits, values and gradients") {
  // float and bfloat16 take the row kernel: a half of 4, of 16 (one AVX-512 vector of floats,
  // moe-small's head size 32) and of 21 (a vector and a remainder); double the TensorIterator loop.
  struct Case {
    at::ScalarType dtype;
    int64_t D;
  };
  for (auto [dtype, D] : {Case{at::kFloat, 8}, Case{at::kFloat, 32}, Case{at::kFloat, 42},
                          Case{at::kBFloat16, 8}, Case{at::kBFloat16, 32}, Case{at::kDouble, 8}}) {
    CAPTURE(dtype);
    CAPTURE(D);
    at::manual_seed(7);
    const int64_t B = 3, T = 5, H = 2;
    const auto base = at::randn({B, T, 3, H, D}).to(dtype).requires_grad_();  // the qkv projection
    const auto angles = at::randn({T, D});
    const auto cos = angles.cos().to(dtype), sin = angles.sin().to(dtype);
    const auto weight = at::randn({3, B, H, T, D}).to(dtype);  // a gradient that differs per element

    auto run = [&](bool fused) {
      base.mutable_grad() = at::Tensor();
      at::Tensor q, k, v;
      if (fused) {
        std::tie(q, k, v) = models::rotary_qkv(base, cos, sin);
      } else {
        const auto parts = base.permute({2, 0, 3, 1, 4});
        q = models::rotary_reference(parts[0], cos, sin);
        k = models::rotary_reference(parts[1], cos, sin);
        v = parts[2];
      }
      ((q * weight[0]).sum() + (k * weight[1]).sum() + (v * weight[2]).sum()).backward();
      return std::vector<at::Tensor>{q.detach(), k.detach(), v.detach(), base.grad().clone()};
    };
    const auto fused = run(true), reference = run(false);
    for (size_t i = 0; i < fused.size(); ++i) {
      CAPTURE(i);
      CHECK(at::equal(fused[i], reference[i]));
    }
    // The rotation moves values between the halves: not the identity, nor a product with cos alone.
    CHECK_FALSE(at::allclose(fused[0], base.detach().permute({2, 0, 3, 1, 4})[0] * cos));
  }
  // A gradient whose last dimension is not contiguous (a sum's backward gives an expanded one).
  {
    at::manual_seed(8);
    const int64_t B = 2, T = 4, H = 2, D = 32;
    const auto angles = at::randn({T, D});
    const auto cos = angles.cos(), sin = angles.sin();
    auto grad = [&](bool fused) {
      const auto base = at::randn({B, T, 3, H, D}, at::TensorOptions().dtype(at::kFloat)).requires_grad_();
      at::Tensor q, k;
      if (fused) {
        std::tie(q, k, std::ignore) = models::rotary_qkv(base, cos, sin);
      } else {
        const auto parts = base.permute({2, 0, 3, 1, 4});
        q = models::rotary_reference(parts[0], cos, sin);
        k = models::rotary_reference(parts[1], cos, sin);
      }
      (q.sum() + 2 * k.sum()).backward();
      return base.grad();
    };
    at::manual_seed(9);
    const auto fused = grad(true);
    at::manual_seed(9);
    CHECK(at::equal(fused, grad(false)));
  }
  CHECK_THROWS_WITH_AS(models::rotary_qkv(at::zeros({2, 4, 3, 2, 8}), at::zeros({5, 8}), at::zeros({5, 8})),
                       doctest::Contains("cos and sin must be [4, 8]"), c10::Error);
}

TEST_CASE("attention: the fused causal kernel equals softmax(q k^T / sqrt(d) + causal mask) v") {
  auto c = small_config();
  at::manual_seed(11);
  models::Attention attn(c);
  const int64_t B = 2, T = 7, D = c.dim, H = c.heads, hd = D / H;
  const auto x = at::randn({B, T, D}).requires_grad_();
  const auto y = attn->forward(x);

  // The same attention with the score matrix written out.
  const auto x2 = x.detach().clone().requires_grad_();
  const auto qkv = attn->qkv(x2).view({B, T, 3, H, hd}).permute({2, 0, 3, 1, 4});  // [3, B, H, T, hd]
  const auto [cos, sin] = models::rotary_tables(T, hd, c.rope_theta, at::TensorOptions().dtype(at::kFloat));
  const auto q = models::rotary_reference(qkv[0], cos, sin), k = models::rotary_reference(qkv[1], cos, sin);
  const auto expected =
      attn->out(attention_f64(q, k, qkv[2]).to(at::kFloat).transpose(1, 2).reshape({B, T, D}));
  CHECK(at::allclose(y, expected, 1e-5, 1e-6));

  y.pow(2).sum().backward();
  expected.pow(2).sum().backward();
  CHECK(at::allclose(x.grad(), x2.grad(), 1e-4, 1e-6));
  // A second call of another length takes its own rotary tables.
  const auto shorter = attn->forward(x.detach().narrow(1, 0, 4));
  CHECK(at::allclose(shorter, y.detach().narrow(1, 0, 4), 1e-5, 1e-6));
}

namespace {

// Largest |a - b| / (|b| + floor) over the elements: a relative bound that does not blow up at 0.
double worst(const at::Tensor& a, const at::Tensor& b, double floor) {
  const auto af = a.to(at::kDouble), bf = b.to(at::kDouble);
  return ((af - bf).abs() / (bf.abs() + floor)).max().item<double>();
}

// f on x at 1 and at 2 intra-op threads: the values and the gradients of x and of `leaves` must be
// the same bits.
void check_thread_independent(const std::function<at::Tensor(const at::Tensor&)>& f, const at::Tensor& x,
                              std::vector<at::Tensor> leaves = {}) {
  const int before = at::get_num_threads();
  std::vector<std::vector<at::Tensor>> out;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    for (auto& l : leaves) l.mutable_grad() = at::Tensor();
    const auto xi = x.detach().clone().requires_grad_();
    const auto y = f(xi);
    y.backward(at::ones_like(y));
    out.push_back({y.detach(), xi.grad()});
    for (const auto& l : leaves) out.back().push_back(l.grad());
  }
  at::set_num_threads(before);
  for (size_t i = 0; i < out[0].size(); ++i) {
    CAPTURE(i);
    CHECK(at::equal(out[0][i], out[1][i]));
  }
}

}  // namespace

TEST_CASE("rms_norm: the fused CPU kernel agrees with the ATen composition, values and gradients") {
  at::manual_seed(5);
  // Rows that split into several blocks and thread ranges, a width that is no multiple of the
  // vector lanes, a transposed (non-contiguous) input, and bfloat16 with a float32 gain.
  struct Case {
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    bool transposed;
    double bound_y, bound_dx, bound_dw;
  };
  for (const Case& k : {Case{{3, 5, 128}, at::kFloat, false, 2e-6, 2e-5, 1e-4},
                        Case{{4100, 37}, at::kFloat, false, 2e-6, 2e-5, 1e-4},
                        Case{{37, 70}, at::kFloat, true, 2e-6, 2e-5, 1e-4},
                        Case{{6, 33, 128}, at::kBFloat16, false, 1e-2, 1e-2, 1e-4}}) {
    CAPTURE(k.shape);
    auto x = (3 * at::randn(k.shape)).to(k.dtype);
    if (k.transposed) x = x.t();
    const int64_t D = x.size(-1);
    const auto w = (1 + 0.5 * at::randn({D})).requires_grad_();
    const auto g = at::randn(x.sizes()).to(k.dtype);
    const auto x1 = x.clone().requires_grad_(), x2 = x.clone().requires_grad_();
    const auto w1 = w.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    REQUIRE(x1.is_contiguous() != k.transposed);
    const auto y1 = models::rms_norm(x1, w1, 1e-5);
    const auto y2 = models::rms_norm_reference(x2, w2, 1e-5);
    REQUIRE((y1.scalar_type() == k.dtype));
    CHECK(worst(y1, y2, 1e-2) < k.bound_y);
    y1.backward(g);
    y2.backward(g);
    REQUIRE((x1.grad().scalar_type() == k.dtype));
    CHECK(worst(x1.grad(), x2.grad(), 1e-2) < k.bound_dx);
    // The gain's gradient, a float32 sum over every row in both.
    CHECK(worst(w1.grad(), w2.grad(), 1e-2) < k.bound_dw);
  }
  // Enough rows that ATen would split a sum over them between threads.
  const auto w = (at::rand({128}) + 0.5).requires_grad_();
  check_thread_independent([&](const at::Tensor& x) { return models::rms_norm(x, w, 1e-5); },
                           at::randn({40000, 128}), {w});
  // A row of zeros normalises to zeros (eps keeps it finite), a NaN stays in its row.
  auto x = at::randn({3, 64});
  x[0].zero_();
  x[1][7] = std::numeric_limits<float>::quiet_NaN();
  const auto y = models::rms_norm(x, at::ones({64}), 1e-5);
  CHECK(at::equal(y[0], at::zeros({64})));
  CHECK(y[1].isnan().all().item<bool>());
  CHECK(at::allclose(y[2], models::rms_norm_reference(x[2], at::ones({64}), 1e-5), 1e-6, 1e-7));
  CHECK_THROWS_WITH_AS(models::rms_norm(x, at::ones({63}), 1e-5), doctest::Contains("last dimension"),
                       c10::Error);
}

TEST_CASE("residual_rms_norm: the kernel gives x + r and its norm, values and both outputs' gradients") {
  at::manual_seed(6);
  struct Case {
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    bool residual;
    double bound_y, bound_dx, bound_dw;
  };
  for (const Case& k : {Case{{4100, 37}, at::kFloat, true, 2e-6, 2e-5, 1e-4},
                        Case{{3, 5, 128}, at::kFloat, false, 2e-6, 2e-5, 1e-4},
                        Case{{6, 33, 128}, at::kBFloat16, true, 1e-2, 1e-2, 1e-4},
                        Case{{6, 33, 128}, at::kBFloat16, false, 1e-2, 1e-2, 1e-4}}) {
    CAPTURE(k.shape);
    CAPTURE(k.residual);
    const auto x = (3 * at::randn(k.shape)).to(k.dtype), r = at::randn(k.shape).to(k.dtype);
    const int64_t D = x.size(-1);
    const auto w = 1 + 0.5 * at::randn({D});
    const auto gs = at::randn(k.shape).to(k.dtype), gy = at::randn(k.shape).to(k.dtype);
    const auto xi = x.clone().requires_grad_(), ri = r.clone().requires_grad_(),
               wi = w.clone().requires_grad_();
    const auto [sum, y] = models::residual_rms_norm(xi, k.residual ? ri : at::Tensor(), wi, 1e-5);
    torch::autograd::backward({sum, y}, {gs, gy});
    // The sum is one rounding of x + r, as the composition's.
    CHECK(at::equal(sum, k.residual ? x + r : x));
    // Against float64 from the same inputs and the same rounded sum: in bfloat16 the composition
    // rounds the norm's input gradient before adding the sum's, so the kernel is held to the exact
    // value instead.
    const auto xd = x.to(at::kDouble).requires_grad_(), rd = r.to(at::kDouble).requires_grad_(),
               wd = w.to(at::kDouble).requires_grad_();
    const auto exact = k.residual ? xd + rd : xd;
    const auto sd = exact + (sum.to(at::kDouble) - exact).detach();
    const auto yd = models::rms_norm_reference(sd, wd, 1e-5);
    torch::autograd::backward({sd, yd}, {gs.to(at::kDouble), gy.to(at::kDouble)});
    CHECK(worst(y, yd, 1e-2) < k.bound_y);
    // x's gradient: the sum's own plus the norm's backward, and r's the same.
    CHECK(worst(xi.grad(), xd.grad(), 1e-2) < k.bound_dx);
    if (k.residual) CHECK(at::equal(ri.grad(), xi.grad()));
    CHECK(worst(wi.grad(), wd.grad(), 1e-2) < k.bound_dw);
  }
  // One output's gradient alone: the sum's passes through as it is; the norm's is rms_norm's.
  const auto x = at::randn({70, 48}), r = at::randn({70, 48}), w = 1 + 0.5 * at::randn({48}),
             g = at::randn({70, 48});
  {
    const auto xi = x.clone().requires_grad_(), ri = r.clone().requires_grad_(),
               wi = w.clone().requires_grad_();
    models::residual_rms_norm(xi, ri, wi, 1e-5).first.backward(g);
    CHECK(at::equal(xi.grad(), g));
    CHECK(at::equal(ri.grad(), g));
    CHECK(at::equal(wi.grad(), at::zeros_like(w)));
  }
  {
    const auto xi = x.clone().requires_grad_(), ri = r.clone().requires_grad_(),
               wi = w.clone().requires_grad_();
    const auto x2 = (x + r).requires_grad_(), w2 = w.clone().requires_grad_();
    models::residual_rms_norm(xi, ri, wi, 1e-5).second.backward(g);
    models::rms_norm(x2, w2, 1e-5).backward(g);
    CHECK(at::equal(xi.grad(), x2.grad()));
    CHECK(at::equal(ri.grad(), x2.grad()));
    CHECK(at::equal(wi.grad(), w2.grad()));
  }
  {
    // In float32, both gradients at once: the bits of ATen's add, rms_norm's kernel and autograd's
    // sum of the two gradients, which the kernel stands for.
    const auto gs = at::randn({70, 48});
    const auto xi = x.clone().requires_grad_(), ri = r.clone().requires_grad_(),
               wi = w.clone().requires_grad_();
    const auto x2 = x.clone().requires_grad_(), r2 = r.clone().requires_grad_(),
               w2 = w.clone().requires_grad_();
    const auto [sum, y] = models::residual_rms_norm(xi, ri, wi, 1e-5);
    const auto sum2 = x2 + r2;
    const auto y2 = models::rms_norm(sum2, w2, 1e-5);
    torch::autograd::backward({sum, y}, {gs, g});
    torch::autograd::backward({sum2, y2}, {gs, g});
    CHECK(at::equal(y, y2));
    CHECK(at::equal(xi.grad(), x2.grad()));
    CHECK(at::equal(ri.grad(), r2.grad()));
    CHECK(at::equal(wi.grad(), w2.grad()));
  }
  // Threads do not change the bits; r of another shape or dtype is refused by name.
  const auto wt = (at::rand({128}) + 0.5).requires_grad_(), rt = at::randn({40000, 128}).requires_grad_();
  check_thread_independent(
      [&](const at::Tensor& xt) {
        const auto [sum, y] = models::residual_rms_norm(xt, rt, wt, 1e-5);
        return sum * 0.5 + y;
      },
      at::randn({40000, 128}), {wt, rt});
  CHECK_THROWS_WITH_AS(models::residual_rms_norm(x, r.narrow(0, 0, 69), w, 1e-5),
                       doctest::Contains("does not match x"), c10::Error);
  CHECK_THROWS_WITH_AS(models::residual_rms_norm(x, r.to(at::kDouble), w, 1e-5),
                       doctest::Contains("does not match x"), c10::Error);
}

TEST_CASE("swiglu: the fused CPU kernel agrees with silu(a) * b, values and gradients, across exp's range") {
  at::manual_seed(6);
  // a over [-100, 100] (exp's clamping and the whole sigmoid), b random; an odd length.
  const int64_t n = 20011;
  const auto a = at::linspace(-100, 100, n).requires_grad_(), b = at::randn({n}).requires_grad_();
  const auto a2 = a.detach().clone().requires_grad_(), b2 = b.detach().clone().requires_grad_();
  const auto g = at::randn({n});
  const auto y = models::swiglu(a, b), expected = models::swiglu_reference(a2, b2);
  CHECK(worst(y, expected, 1e-30) < 1e-5);
  y.backward(g);
  expected.backward(g);
  CHECK(worst(a.grad(), a2.grad(), 1e-30) < 1e-4);
  CHECK(worst(b.grad(), b2.grad(), 1e-30) < 1e-5);
  // Where the values are ordinary, a few float32 ulps.
  const auto mid = (at::randn({4, 1000}) * 4).requires_grad_(), other = at::randn({4, 1000});
  const auto mid2 = mid.detach().clone().requires_grad_();
  const auto ym = models::swiglu(mid, other), ym2 = models::swiglu_reference(mid2, other);
  CHECK(worst(ym, ym2, 1e-6) < 1e-6);
  ym.sum().backward();
  ym2.sum().backward();
  CHECK(worst(mid.grad(), mid2.grad(), 1e-2) < 1e-5);  // the floor: d silu / da crosses zero
  const auto nan = models::swiglu(at::full({3}, std::numeric_limits<float>::quiet_NaN()), at::ones({3}));
  CHECK(nan.isnan().all().item<bool>());
  const auto bb = at::randn({5000});
  check_thread_independent([&](const at::Tensor& x) { return models::swiglu(x, bb); }, at::randn({5000}) * 5);
}

namespace {

// Float64 leaves of x and the experts' weights, and their SwiGLU expert by expert over the rows
// `ends` gives each (zeros past the last end), for expert_swiglu's tests.
struct ExpertsF64 {
  at::Tensor x, w1, w3, w2, y;
};
ExpertsF64 experts_f64(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                       const std::vector<int64_t>& ends) {
  const auto leaf = [](const at::Tensor& t) { return t.detach().to(at::kDouble).requires_grad_(); };
  ExpertsF64 r{leaf(x), leaf(w1), leaf(w3), leaf(w2), {}};
  std::vector<at::Tensor> parts;
  for (size_t e = 0, begin = 0; e < ends.size(); begin = size_t(ends[e]), ++e) {
    const auto rows = r.x.narrow(0, int64_t(begin), ends[e] - int64_t(begin));
    const auto i = int64_t(e);
    parts.push_back(at::mm(at::silu(at::mm(rows, r.w1[i].t())) * at::mm(rows, r.w3[i].t()), r.w2[i].t()));
  }
  parts.push_back(at::zeros({x.size(0) - ends.back(), x.size(1)}, r.x.options()));
  r.y = at::cat(parts);
  return r;
}

// Largest |a - b| over b's largest element: float32 products of tens to hundreds of terms stay near 1e-7.
double relative_to_largest(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b).abs().max().item<double>() / b.abs().max().item<double>();
}

}  // namespace

TEST_CASE(
    "expert_swiglu: each expert's SwiGLU on its own rows against float64, values and the four gradients") {
  at::manual_seed(17);
  // Experts of 130 rows (a chunk and 2), none, 1 and 257 (two chunks and 1), then 5 rows past the
  // last end.
  const int64_t E = 4, D = 48, H = 40, N = 393;
  const std::vector<int64_t> ends = {130, 130, 131, 388};
  const auto ends_t = at::tensor(ends, at::kLong).to(at::kInt);
  const auto x = at::randn({N, D}).requires_grad_();
  const auto w1 = (at::randn({E, H, D}) * 0.2).requires_grad_(),
             w3 = (at::randn({E, H, D}) * 0.2).requires_grad_(),
             w2 = (at::randn({E, D, H}) * 0.2).requires_grad_();
  const auto y = models::expert_swiglu(x, w1, w3, w2, ends_t);
  const auto g = at::randn({N, D});
  y.backward(g);

  const auto d = experts_f64(x, w1, w3, w2, ends);
  const auto &yd = d.y, &xd = d.x, &w1d = d.w1, &w3d = d.w3, &w2d = d.w2;
  yd.backward(g.to(at::kDouble));
  const auto err = relative_to_largest;
  CHECK(err(y, yd) < 1e-5);
  CHECK(err(x.grad(), xd.grad()) < 1e-5);
  CHECK(err(w1.grad(), w1d.grad()) < 1e-5);
  CHECK(err(w3.grad(), w3d.grad()) < 1e-5);
  CHECK(err(w2.grad(), w2d.grad()) < 1e-5);
  // Per expert too, so that a wrong small expert cannot hide under a large one.
  for (const int64_t e : {0, 2, 3}) {
    CAPTURE(e);
    CHECK(err(w1.grad()[e], w1d.grad()[e]) < 1e-5);
    CHECK(err(w2.grad()[e], w2d.grad()[e]) < 1e-5);
  }
  // The expert without rows gets zero gradients; rows past the last end are zero, and so is x's
  // gradient there.
  for (const auto* w : {&w1, &w3, &w2}) CHECK(at::equal(w->grad()[1], at::zeros_like(w->grad()[1])));
  CHECK(at::equal(y.detach().narrow(0, 388, 5), at::zeros({5, D})));
  CHECK(at::equal(x.grad().narrow(0, 388, 5), at::zeros({5, D})));

  check_thread_independent(
      [&](const at::Tensor& xi) { return models::expert_swiglu(xi, w1, w3, w2, ends_t); }, x.detach(),
      {w1, w3, w2});

  // Bad ends and shapes are refused, naming them.
  CHECK_THROWS_WITH_AS(
      models::expert_swiglu(x, w1, w3, w2, at::tensor(std::vector<int64_t>{5, 4, 6, 9}, at::kLong)),
      doctest::Contains("expert_swiglu: ends must be non-decreasing"), c10::Error);
  CHECK_THROWS_WITH_AS(models::expert_swiglu(x, w1, w3, w1, ends_t),
                       doctest::Contains("w2 [experts, dim, hidden]"), c10::Error);
}

TEST_CASE("expert_swiglu: chunks of any size, a large expert's weights' gradients summed over many of them") {
  at::manual_seed(19);
  // 2500 rows for the first expert (20 chunks of 128, 25 of 100, 358 of 7, one of 5000), 3 for the
  // second.
  const int64_t E = 2, D = 16, H = 24, N = 2503;
  const std::vector<int64_t> expert_ends = {2500, 2503};
  const auto ends = at::tensor(expert_ends, at::kLong);
  const auto x = at::randn({N, D}).requires_grad_();
  const auto w1 = (at::randn({E, H, D}) * 0.3).requires_grad_(),
             w3 = (at::randn({E, H, D}) * 0.3).requires_grad_(),
             w2 = (at::randn({E, D, H}) * 0.3).requires_grad_();
  const auto g = at::randn({N, D});
  const auto d = experts_f64(x, w1, w3, w2, expert_ends);
  const auto &yd = d.y, &xd = d.x, &w1d = d.w1, &w3d = d.w3, &w2d = d.w2;
  yd.backward(g.to(at::kDouble));
  const auto err = relative_to_largest;
  for (const int64_t chunk : {int64_t(128), int64_t(100), int64_t(7), int64_t(5000)}) {
    CAPTURE(chunk);
    for (const auto* t : {&x, &w1, &w3, &w2}) t->mutable_grad() = at::Tensor();
    const auto y = models::expert_swiglu(x, w1, w3, w2, ends, chunk);
    y.backward(g);
    CHECK(err(y, yd) < 1e-5);
    CHECK(err(x.grad(), xd.grad()) < 1e-5);
    for (int64_t e = 0; e < E; ++e) {
      CAPTURE(e);
      CHECK(err(w1.grad()[e], w1d.grad()[e]) < 1e-5);
      CHECK(err(w3.grad()[e], w3d.grad()[e]) < 1e-5);
      CHECK(err(w2.grad()[e], w2d.grad()[e]) < 1e-5);
    }
  }
  check_thread_independent([&](const at::Tensor& xi) { return models::expert_swiglu(xi, w1, w3, w2, ends); },
                           x.detach(), {w1, w3, w2});
  CHECK_THROWS_WITH_AS(models::expert_swiglu(x, w1, w3, w2, ends, 0),
                       doctest::Contains("chunk_rows must be at least 1"), c10::Error);
}

// The kernels clamp exp's argument; compiled so that a clamped path ran on every lane, SwiGLU
// multiplied each element by 1 / (1 + e^88), a subnormal float, and Intel CPUs take a microcode
// assist for each such product (CMakeLists.txt, -fno-thread-jumps). Ordinary inputs must raise no
// underflow, forward or backward; a product that does underflow shows the flag is read.
TEST_CASE("fused kernels: ordinary inputs make no subnormal floats, forward or backward") {
  const int before = at::get_num_threads();
  at::set_num_threads(1);  // the floating-point flags are the calling thread's
  at::manual_seed(9);
  auto underflows = [](const std::function<void()>& f) {
    std::feclearexcept(FE_ALL_EXCEPT);
    f();
    return std::fetestexcept(FE_UNDERFLOW) != 0;
  };
  {
    const auto tiny = at::full({64}, 1e-30f);
    CHECK(underflows([&] { (void)(tiny * tiny); }));  // the control: 1e-60 underflows
  }
  auto check = [&](const std::string& kernel,
                   const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f,
                   std::vector<at::Tensor> in) {
    CAPTURE(kernel);
    for (auto& t : in) t.requires_grad_();
    at::Tensor y;
    CHECK_FALSE(underflows([&] { y = f(in); }));
    const auto g = at::randn(y.sizes());
    CHECK_FALSE(underflows([&] { y.backward(g); }));
    for (const auto& t : in) CHECK(t.grad().defined());
  };
  check("swiglu", [](const auto& in) { return models::swiglu(in[0], in[1]); },
        {at::randn({512, 384}) * 3, at::randn({512, 384})});
  check("rms_norm", [](const auto& in) { return models::rms_norm(in[0], in[1], 1e-5); },
        {at::randn({512, 128}), 1 + 0.1 * at::randn({128})});
  REQUIRE(models::causal_attention_available());
  check("causal_attention", [](const auto& in) { return models::causal_attention(in[0], in[1], in[2]); },
        {at::randn({2, 4, 128, 32}), at::randn({2, 4, 128, 32}), at::randn({2, 4, 128, 32})});
  at::set_num_threads(before);
}

namespace {

// q, k, v [B, H, T, D] laid out three ways: [B, T, H, D] in memory (as the model's are),
// contiguous, and with D not innermost.
at::Tensor laid_out(const at::Tensor& x, int way) {
  if (way == 0) return x.permute({0, 2, 1, 3}).contiguous().permute({0, 2, 1, 3});
  if (way == 1) return x.contiguous();
  return x.transpose(2, 3).contiguous().transpose(2, 3);
}

}  // namespace

TEST_CASE("causal_attention: the CPU kernel equals the float64 composition, values and gradients") {
  REQUIRE(models::causal_attention_available());
  at::manual_seed(21);
  // One block, a block and one row, several blocks with a partial last one; head sizes the BLAS
  // and the row loops take whole and not.
  for (const auto& [T, D] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {7, 32}, {64, 32}, {65, 16}, {200, 24}}) {
    for (int way = 0; way < 3; ++way) {
      CAPTURE(T);
      CAPTURE(D);
      CAPTURE(way);
      const int64_t B = 2, H = 3;
      std::vector<at::Tensor> in, ref;
      for (int i = 0; i < 3; ++i) {
        const auto x = at::randn({B, H, T, D});
        ref.push_back(x.to(at::kDouble).requires_grad_());
        in.push_back(laid_out(x, way).requires_grad_());
      }
      const auto y = models::causal_attention(in[0], in[1], in[2]);
      const auto expected = attention_f64(ref[0], ref[1], ref[2]);
      CHECK(bool(y.scalar_type() == at::kFloat));
      CHECK(y.transpose(1, 2).is_contiguous());  // [B, T, H, D] in memory: the model's reshape is a view
      // Relative to the outputs' root mean square: an output near zero is the sum of larger terms.
      CHECK(worst(y, expected, expected.pow(2).mean().sqrt().item<double>()) < 1e-5);
      const auto g = at::randn({B, H, T, D});
      y.backward(g);
      expected.backward(g.to(at::kDouble));
      // Relative to the largest gradient of the three (with one key, T = 1, a query's and a key's
      // are zero, and the kernel's their rounding).
      double floor = 0;
      for (int i = 0; i < 3; ++i) floor = std::max(floor, 1e-2 * ref[i].grad().abs().max().item<double>());
      for (int i = 0; i < 3; ++i) {
        CAPTURE(i);
        REQUIRE(in[i].grad().defined());
        CHECK(worst(in[i].grad(), ref[i].grad(), floor) < 1e-4);
      }
    }
  }
}

TEST_CASE(
    "causal_attention: large scores stay finite, rows see only earlier keys, threads do not change bits") {
  at::manual_seed(22);
  const int64_t B = 2, H = 2, T = 130, D = 32;
  // Scores in the hundreds: softmax must subtract each row's maximum.
  const auto q = at::randn({B, H, T, D}) * 30, k = at::randn({B, H, T, D}), v = at::randn({B, H, T, D});
  const auto y = models::causal_attention(q, k, v);
  CHECK(y.isfinite().all().item<bool>());
  // Scores this large carry float32's rounding into the exponent: about 1e-3 of an output here, as
  // for scaled_dot_product_attention.
  CHECK(worst(y, attention_f64(q, k, v), 1e-3) < 1e-2);
  // Changing key and value rows past position t leaves the outputs up to t unchanged, bit for bit.
  const int64_t t = 70;
  auto k2 = k.clone(), v2 = v.clone();
  k2.narrow(2, t + 1, T - t - 1).normal_();
  v2.narrow(2, t + 1, T - t - 1).normal_();
  const auto y2 = models::causal_attention(q, k2, v2);
  CHECK(at::equal(y.narrow(2, 0, t + 1), y2.narrow(2, 0, t + 1)));
  CHECK_FALSE(at::equal(y.narrow(2, t + 1, T - t - 1), y2.narrow(2, t + 1, T - t - 1)));
  // Heads are split between threads whole: 1 and 2 threads give the same bits, values and gradients.
  const auto w = at::randn({B, H, T, D});
  check_thread_independent(
      [&](const at::Tensor& x) { return models::causal_attention(x[0], x[1], x[2]) * w; },
      at::randn({3, B, H, T, D}));
}

TEST_CASE(
    "rotary_causal_attention: the one-pass kernel gives rotary_qkv then causal_attention, values and "
    "gradients") {
  REQUIRE(models::causal_attention_available());
  // One block, a partial block, several blocks with a partial last one; head sizes whose rotated
  // half is under, at and past one AVX-512 vector of floats.
  for (const auto& [T, D] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {7, 32}, {64, 32}, {65, 16}, {200, 42}}) {
    CAPTURE(T);
    CAPTURE(D);
    at::manual_seed(24);
    const int64_t B = 2, H = 3;
    const auto angles = at::randn({T, D});
    const auto cos = angles.cos(), sin = angles.sin();
    const auto qkv = at::randn({B, T, 3, H, D});
    const auto g = at::randn({B, H, T, D});
    auto run = [&](bool one_pass) {
      const auto x = qkv.clone().requires_grad_();
      at::Tensor y;
      if (one_pass) {
        y = models::rotary_causal_attention(x, cos, sin);
      } else {
        const auto [q, k, v] = models::rotary_qkv(x, cos, sin);
        y = models::causal_attention(q, k, v);
      }
      y.backward(g);
      return std::pair{y.detach(), x.grad()};
    };
    const auto [y, grad] = run(true);
    const auto [y2, grad2] = run(false);
    CHECK(y.transpose(1, 2).is_contiguous());  // [B, T, H, D] in memory: the model's reshape is a view
    // The same float operations on the same values; the BLAS is handed other leading dimensions
    // (a head's rows in scratch against [B, T, H, D] tensors), which may regroup no sum but is
    // allowed the last bit.
    CHECK(worst(y, y2, y2.pow(2).mean().sqrt().item<double>()) < 1e-6);
    CHECK(worst(grad, grad2, grad2.pow(2).mean().sqrt().item<double>()) < 1e-6);
    // And the float64 composition: rotation and attention, q and k rotated, v not.
    const auto p = qkv.to(at::kDouble).permute({2, 0, 3, 1, 4});
    const auto cd = cos.to(at::kDouble), sd = sin.to(at::kDouble);
    const auto expected =
        attention_f64(models::rotary_reference(p[0], cd, sd), models::rotary_reference(p[1], cd, sd), p[2]);
    CHECK(worst(y, expected, expected.pow(2).mean().sqrt().item<double>()) < 1e-5);
  }
  // Heads are split between threads whole: 1 and 2 threads give the same bits.
  at::manual_seed(25);
  const int64_t B = 2, H = 2, T = 70, D = 32;
  const auto angles = at::randn({T, D});
  const auto cos = angles.cos(), sin = angles.sin();
  const auto w = at::randn({B, H, T, D});
  check_thread_independent(
      [&](const at::Tensor& x) { return models::rotary_causal_attention(x, cos, sin) * w; },
      at::randn({B, T, 3, H, D}));
  // Elsewhere (double) the two calls; a bad shape is refused with rotary_qkv's message.
  const auto qd = at::randn({1, 9, 3, 2, 8}, at::kDouble);
  const auto cd = angles.narrow(0, 0, 9).narrow(1, 0, 8).cos().to(at::kDouble),
             sd = angles.narrow(0, 0, 9).narrow(1, 0, 8).sin().to(at::kDouble);
  const auto [q, k, v] = models::rotary_qkv(qd, cd, sd);
  CHECK(at::equal(models::rotary_causal_attention(qd, cd, sd), models::causal_attention(q, k, v)));
  CHECK_THROWS_WITH_AS(
      models::rotary_causal_attention(at::zeros({2, 4, 3, 2, 8}), at::zeros({5, 8}), at::zeros({5, 8})),
      doctest::Contains("cos and sin must be [4, 8]"), c10::Error);
}

TEST_CASE(
    "rotary_causal_attention: bfloat16 on the CPU runs the float32 kernel on the widened values, the result "
    "rounded once") {
  REQUIRE(models::causal_attention_available());
  at::manual_seed(26);
  const int64_t B = 2, H = 3, T = 70, D = 32;
  const auto angles = at::randn({T, D});
  const auto cos = angles.cos().to(at::kBFloat16), sin = angles.sin().to(at::kBFloat16);
  const auto qkv = at::randn({B, T, 3, H, D}).to(at::kBFloat16);
  const auto g = at::randn({B, H, T, D}).to(at::kBFloat16);
  const auto x = qkv.clone().requires_grad_();
  const auto y = models::rotary_causal_attention(x, cos, sin);
  y.backward(g);
  CHECK((y.scalar_type() == at::kBFloat16));
  CHECK((x.grad().scalar_type() == at::kBFloat16));
  CHECK(y.transpose(1, 2).is_contiguous());  // [B, T, H, D] in memory: the model's reshape is a view
  // The float32 kernel's values and gradient, each rounded once to bfloat16.
  const auto wide = qkv.to(at::kFloat).requires_grad_();
  const auto yw = models::rotary_causal_attention(wide, cos.to(at::kFloat), sin.to(at::kFloat));
  yw.backward(g.to(at::kFloat));
  CHECK(at::equal(y, yw.detach().to(at::kBFloat16)));
  CHECK(at::equal(x.grad(), wide.grad().to(at::kBFloat16)));
  // Against float64 on the same bfloat16 values: within bfloat16's rounding of the result, where
  // the bfloat16 composition (rotary_qkv, then scaled_dot_product_attention's flash attention,
  // which rounds its probabilities to bfloat16) is further off.
  const auto p = qkv.to(at::kDouble).permute({2, 0, 3, 1, 4});
  const auto cd = cos.to(at::kDouble), sd = sin.to(at::kDouble);
  const auto expected =
      attention_f64(models::rotary_reference(p[0], cd, sd), models::rotary_reference(p[1], cd, sd), p[2]);
  const double scale = expected.pow(2).mean().sqrt().item<double>();
  const auto [q, k, v] = models::rotary_qkv(qkv, cos, sin);
  const auto composition = models::causal_attention(q, k, v);
  const double own_error = worst(y, expected, scale), composition_error = worst(composition, expected, scale);
  MESSAGE("worst error over the rms: widened kernel " << own_error << ", bfloat16 composition "
                                                      << composition_error);
  CHECK(own_error < 1.0 / 64);
  CHECK(own_error <= composition_error);
}

TEST_CASE("softmax_top_k: the CPU kernel agrees with softmax, topk and logsumexp, values and gradients") {
  at::manual_seed(33);
  // One expert, k = E, a width past one vector of floats; normalised and not.
  for (const auto& [T, E, k, normalize] : std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>{
           {5, 1, 1, true}, {40, 4, 2, true}, {40, 4, 4, true}, {33, 19, 3, false}, {300, 8, 1, false}}) {
    CAPTURE(T);
    CAPTURE(E);
    CAPTURE(k);
    CAPTURE(normalize);
    const auto logits = 3 * at::randn({T, E});
    const auto gs = at::randn({T, E}), gz = at::randn({T}), gw = at::randn({T, k});
    auto run = [&](bool fused) {
      const auto l = logits.clone().requires_grad_();
      const auto r =
          fused ? models::softmax_top_k(l, k, normalize) : models::softmax_top_k_reference(l, k, normalize);
      ((r.scores * gs).sum() + (r.lse * gz).sum() + (r.weights * gw).sum()).backward();
      return std::tuple{r, l.grad()};
    };
    const auto [r, dl] = run(true);
    const auto [r2, dl2] = run(false);
    CHECK(at::equal(r.experts, r2.experts));
    CHECK(worst(r.scores, r2.scores, 1e-3) < 1e-6);
    CHECK(worst(r.lse, r2.lse, 1e-3) < 1e-6);
    CHECK(worst(r.weights, r2.weights, 1e-3) < 1e-6);
    CHECK(worst(dl, dl2, dl2.pow(2).mean().sqrt().item<double>()) < 1e-5);
    CHECK_FALSE(r.experts.requires_grad());
  }
  // Only the weights used (the others' gradients never arrive), and equal logits: the lower expert
  // wins the tie, its weight and gradient as for distinct ones.
  auto l = at::tensor({0.5f, 2.0f, 2.0f, -1.0f}).view({1, 4}).requires_grad_();
  const auto r = models::softmax_top_k(l, 2, true);
  CHECK(r.experts.view(-1)[0].item<int64_t>() == 1);
  CHECK(r.experts.view(-1)[1].item<int64_t>() == 2);
  CHECK(r.weights.view(-1)[0].item<float>() == doctest::Approx(0.5));
  r.weights.select(1, 0).sum().backward();
  const auto l2 = l.detach().clone().requires_grad_();
  const auto s2 = at::softmax(l2, -1);
  (s2.select(1, 1) / (s2.select(1, 1) + s2.select(1, 2))).sum().backward();
  CHECK(at::allclose(l.grad(), l2.grad(), 1e-5, 1e-6));
  // Rows split between threads: 1 and 2 threads give the same bits.
  const auto mix = at::randn({5000, 6});
  check_thread_independent(
      [&](const at::Tensor& x) {
        const auto r = models::softmax_top_k(x, 2, true);
        return (r.scores * mix).sum(-1) + r.lse + r.weights.sum(-1) * 0.5;
      },
      at::randn({5000, 6}));
  // Other dtypes take the reference; a k the logits cannot give is refused.
  const auto ld = at::randn({7, 4}, at::kDouble);
  CHECK(at::equal(models::softmax_top_k(ld, 2, true).weights,
                  models::softmax_top_k_reference(ld, 2, true).weights));
  CHECK_THROWS_WITH_AS(models::softmax_top_k(at::zeros({3, 4}), 5, true),
                       doctest::Contains("1 <= k <= experts"), c10::Error);
}

TEST_CASE(
    "sort_by_expert: the stable sort by expert, its inverse and the counts; a choice out of range is named") {
  at::manual_seed(31);
  const int64_t T = 37, k = 3, E = 6;
  const auto experts = at::randint(0, E - 1, {T, k}, at::kLong);  // expert 5 gets no rows
  const auto o = models::sort_by_expert(experts, E);
  CHECK(o.top_k == k);
  CHECK(at::equal(o.order, std::get<1>(at::sort(experts.reshape(-1), /*stable=*/true, 0, false))));
  CHECK(at::equal(o.counts, at::bincount(experts.reshape(-1), {}, E)));
  CHECK(o.counts[E - 1].item<int64_t>() == 0);
  CHECK(at::equal(o.position.index_select(0, o.order), at::arange(T * k, at::kLong)));
  auto bad = experts.clone();
  bad[4][1] = 7;
  CHECK_THROWS_WITH_AS(models::sort_by_expert(bad, E),
                       doctest::Contains("token 4's choice 1 is expert 7, outside [0, 6)"),
                       std::out_of_range);
  CHECK_THROWS_WITH_AS(models::sort_by_expert(experts.to(at::kInt), E),
                       doctest::Contains("int64 [tokens, top_k]"), c10::Error);
}

TEST_CASE(
    "dispatch_rows and combine_rows: the CPU kernels give index_select and index_add's bits, values and "
    "gradients") {
  at::manual_seed(32);
  // A width that is no multiple of the vector lanes; tokens choosing one expert twice as well as
  // distinct ones (each token's rows are summed in ascending position either way).
  for (const auto& [T, k, E, D] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {1, 1, 1, 8}, {29, 2, 4, 37}, {300, 2, 4, 128}, {50, 4, 3, 16}}) {
    CAPTURE(T);
    CAPTURE(k);
    CAPTURE(D);
    const auto o = models::sort_by_expert(at::randint(0, E, {T, k}, at::kLong), E);
    const auto x = at::randn({T, D}), y = at::randn({T * k, D}), w = at::rand({T, k});
    const auto gx = at::randn({T * k, D}), gout = at::randn({T, D});
    auto dispatch = [&](bool fused) {
      const auto xi = x.clone().requires_grad_();
      const auto rows = fused ? models::dispatch_rows(xi, o) : models::dispatch_rows_reference(xi, o);
      rows.backward(gx);
      return std::pair{rows.detach(), xi.grad()};
    };
    const auto [rows, dx] = dispatch(true);
    const auto [rows2, dx2] = dispatch(false);
    CHECK(at::equal(rows, rows2));
    CHECK(at::equal(dx, dx2));
    auto combine = [&](bool fused) {
      const auto yi = y.clone().requires_grad_(), wi = w.clone().requires_grad_();
      const auto out = fused ? models::combine_rows(yi, wi, o) : models::combine_rows_reference(yi, wi, o);
      out.backward(gout);
      return std::tuple{out.detach(), yi.grad(), wi.grad()};
    };
    const auto [out, dy, dw] = combine(true);
    const auto [out2, dy2, dw2] = combine(false);
    CHECK(at::equal(out, out2));
    CHECK(at::equal(dy, dy2));
    // The weights' gradients are dot products over D, summed in another order than ATen's sum:
    // within float32 rounding of the float64 sums, as ATen's are.
    const auto yd = y.to(at::kDouble).index_select(0, o.position).view({T, k, D});
    const auto dw64 = (yd * gout.to(at::kDouble).unsqueeze(1)).sum(2);
    const double scale = dw64.pow(2).mean().sqrt().item<double>();
    CHECK(worst(dw, dw64, scale) < 1e-6);
    CHECK(worst(dw2, dw64, scale) < 1e-6);
    CHECK_FALSE(at::equal(dw.select(1, 0), at::zeros({T})));
    // And by hand in float64: out[t] = sum_j w[t, j] y[position[t k + j]].
    const auto out64 = (yd * w.to(at::kDouble).unsqueeze(2)).sum(1);
    CHECK(worst(out, out64, out64.pow(2).mean().sqrt().item<double>()) < 1e-6);
  }
  // Tokens split between threads: 1 and 2 threads give the same bits.
  const int64_t T = 3000, k = 2, E = 4, D = 64;
  const auto o = models::sort_by_expert(at::randint(0, E, {T, k}, at::kLong), E);
  const auto w = at::rand({T, k}).requires_grad_();
  const auto mix = at::randn({T * k, D});
  check_thread_independent(
      [&](const at::Tensor& x) { return models::combine_rows(models::dispatch_rows(x, o) * mix, w, o); },
      at::randn({T, D}), {w});
  // Other dtypes take the reference; shapes that do not fit the order are refused.
  const auto xd = at::randn({T, D}, at::kDouble);
  CHECK(at::equal(models::dispatch_rows(xd, o), models::dispatch_rows_reference(xd, o)));
  const auto yd = at::randn({T * k, D}, at::kDouble), wd = at::rand({T, k}, at::kDouble);
  CHECK(at::equal(models::combine_rows(yd, wd, o), models::combine_rows_reference(yd, wd, o)));
  CHECK_THROWS_WITH_AS(models::dispatch_rows(at::zeros({T + 1, D}), o),
                       doctest::Contains("does not hold the 3000 tokens"), c10::Error);
  CHECK_THROWS_WITH_AS(models::combine_rows(at::zeros({T * k, D}), at::zeros({T, k + 1}), o),
                       doctest::Contains("do not match the order of 6000 assignments, top-2"), c10::Error);
}

TEST_CASE(
    "causal_attention: other dtypes go to scaled_dot_product_attention; mismatched shapes are refused") {
  at::manual_seed(23);
  const auto q = at::randn({1, 2, 9, 8}, at::kDouble), k = at::randn({1, 2, 9, 8}, at::kDouble),
             v = at::randn({1, 2, 9, 8}, at::kDouble);
  CHECK(at::equal(models::causal_attention(q, k, v), models::causal_attention_reference(q, k, v)));
  CHECK_THROWS_WITH_AS(
      models::causal_attention(at::zeros({1, 2, 9, 8}), at::zeros({1, 2, 8, 8}), at::zeros({1, 2, 9, 8})),
      doctest::Contains("one shape [B, H, T, D]"), c10::Error);
}

namespace {

// Two models of `c` with the same weights, the second with `off` applied to its config, on the same
// tokens: the logits must agree within float32 rounding of their size (their root mean square: a
// logit near zero differs by as many ulps of the others as any) and every gradient nearly; returns
// both logits.
std::pair<at::Tensor, at::Tensor> only_rounding_apart(MoEConfig c, const std::function<void(MoEConfig&)>& off,
                                                      std::vector<int64_t> tokens_shape) {
  models::MoETransformer on(c);
  off(c);
  models::MoETransformer plain(c);
  {
    at::NoGradGuard ng;
    const auto from = on->named_parameters(), to = plain->named_parameters();
    for (const auto& p : from) to[p.key()].copy_(p.value());
  }
  const auto tokens = at::randint(0, c.vocab_size, tokens_shape);
  const auto lo = on->forward(tokens), lp = plain->forward(tokens);
  CHECK(worst(lo, lp, lp.pow(2).mean().sqrt().item<double>()) < 1e-5);
  models::lm_loss(lo, tokens).backward();
  models::lm_loss(lp, tokens).backward();
  const auto po = on->named_parameters(), pp = plain->named_parameters();
  for (const auto& p : po) {
    CAPTURE(p.key());
    CHECK(worst(p.value().grad(), pp[p.key()].grad(), 1e-4) < 1e-3);
  }
  return {lo, lp};
}

}  // namespace

TEST_CASE("model: fused_kernels changes only the rounding (logits and gradients against the compositions)") {
  auto c = small_config();
  c.dense_layers = 1;
  at::manual_seed(12);
  const auto [fused, plain] = only_rounding_apart(c, [](MoEConfig& c) { c.fused_kernels = false; }, {3, 9});
  CHECK_FALSE(at::equal(fused, plain));  // the kernels did run
}

TEST_CASE(
    "model: fused_attention changes only the rounding (logits and gradients against "
    "scaled_dot_product_attention)") {
  auto c = small_config();
  c.dense_layers = 1;
  at::manual_seed(14);
  const auto [own, sdpa] = only_rounding_apart(c, [](MoEConfig& c) { c.fused_attention = false; }, {3, 20});
  CHECK_FALSE(at::equal(own, sdpa));  // the kernel did run
}

TEST_CASE(
    "model: in bfloat16, own_products changes only the rounding (MKL's bfloat16 products against ATen's)") {
  auto c = small_config();
  c.dense_layers = 1;
  at::manual_seed(15);
  models::MoETransformer own(c);
  c.own_products = false;
  models::MoETransformer aten(c);
  {
    at::NoGradGuard ng;
    const auto from = own->named_parameters(), to = aten->named_parameters();
    for (const auto& p : from) to[p.key()].copy_(p.value());
  }
  own->to(at::kBFloat16);
  aten->to(at::kBFloat16);
  const auto tokens = at::randint(0, c.vocab_size, {3, 40});
  const auto lo = own->forward(tokens), la = aten->forward(tokens);
  // Two bfloat16 models apart by the order of their products' sums: a few bfloat16 roundings of
  // the logits' size through the layers; a wrong product is off by their whole size.
  CHECK(worst(lo, la, la.pow(2).mean().sqrt().item<double>()) < 0.05);
  models::lm_loss(lo, tokens).backward();
  models::lm_loss(la, tokens).backward();
  const auto po = own->named_parameters(), pa = aten->named_parameters();
  for (const auto& p : po) {
    CAPTURE(p.key());
    const auto& expected = pa[p.key()].grad();
    CHECK((p.value().grad().scalar_type() == at::kBFloat16));
    CHECK(worst(p.value().grad(), expected, expected.pow(2).mean().sqrt().item<double>() + 1e-12) < 0.1);
  }
  MESSAGE("MKL's bfloat16 products preferred here: " << std::string(models::bf16_matmul_preferred() ? "yes"
                                                                                                    : "no"));
  if (!models::bf16_matmul_preferred()) CHECK(at::equal(lo, la));
}

TEST_CASE("model: in float32, own_products changes nothing (ATen's products either way)") {
  auto c = small_config();
  c.dense_layers = 1;
  at::manual_seed(13);
  const auto [own, aten] = only_rounding_apart(c, [](MoEConfig& c) { c.own_products = false; }, {3, 40});
  CHECK(at::equal(own, aten));
}
