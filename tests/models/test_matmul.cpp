// The model's products (models/cpu/matmul.hpp): bfloat16 through MKL's bfloat16 kernel, float32 and the
// other dtypes through ATen's, values and gradients against float64, the route taken, grouped rows
// (empty groups, rows past the last end), and bad group ends.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdpp/models/cpu/matmul.hpp"

// What models::linear calls for bfloat16 on the CPU (libtorch_cpu.so's MKL exports it): row-major
// (101), each operand transposed (112) or not (111), float32 C.
extern "C" [[gnu::weak]] void cblas_gemm_bf16bf16f32(int layout, int trans_a, int trans_b, int m, int n,
                                                     int k, float alpha, const uint16_t* a, int lda,
                                                     const uint16_t* b, int ldb, float beta, float* c,
                                                     int ldc);

using namespace fsdpp;

namespace {

// Largest |a - b| over the size of the terms summed into b (for a product x W^T: |x| |W|^T), so
// that float32 rounding, about sqrt(terms) ulps of that size however the sum cancels, stays far
// below the bound, and a wrong product does not.
double scaled_error(const at::Tensor& a, const at::Tensor& b, const at::Tensor& size) {
  return ((a.to(at::kDouble) - b).abs() / (size + 1e-30)).max().item<double>();
}

// Float64 leaves of `t` for a reference: the values, and their absolute values (whose product and
// gradients with |g| give the sizes of the terms).
std::pair<at::Tensor, at::Tensor> references(const at::Tensor& t) {
  const auto d = t.detach().to(at::kDouble);
  return {d.clone().requires_grad_(), d.abs().requires_grad_()};
}

// The float64 reference of grouped_linear: group g's rows times W_g^T, zero past the last end.
at::Tensor grouped_reference(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& ends) {
  auto out = at::zeros({x.size(0), w.size(1)}, x.options().dtype(at::kDouble));
  for (size_t g = 0, begin = 0; g < ends.size(); begin = ends[g], ++g)
    if (ends[g] > static_cast<int64_t>(begin))
      out.narrow(0, begin, ends[g] - begin)
          .copy_(at::mm(x.narrow(0, begin, ends[g] - begin).to(at::kDouble), w[g].to(at::kDouble).t()));
  return out;
}

at::Tensor ends_tensor(const std::vector<int64_t>& ends) { return at::tensor(ends, at::kLong).to(at::kInt); }

}  // namespace

TEST_CASE("linear: float32 products agree with float64, values and both gradients, and are ATen's") {
  at::manual_seed(3);
  const auto x = at::randn({3, 50, 96}).requires_grad_();
  const auto w = (at::randn({40, 96}) * 0.1).requires_grad_();
  const auto y = models::linear(x, w, true);
  CHECK(y.sizes() == at::IntArrayRef{3, 50, 40});
  const auto [xd, xa] = references(x);
  const auto [wd, wa] = references(w);
  const auto yd = at::linear(xd, wd), ya = at::linear(xa, wa);
  CHECK(scaled_error(y, yd, ya) < 1e-5);
  const auto g = at::randn({3, 50, 40});
  y.backward(g);
  yd.backward(g.to(at::kDouble));
  ya.backward(g.to(at::kDouble).abs());
  CHECK(scaled_error(x.grad(), xd.grad(), xa.grad()) < 1e-5);
  CHECK(scaled_error(w.grad(), wd.grad(), wa.grad()) < 1e-5);
  // float32 has no route of its own: ATen's bits whatever `own` says, as for any other dtype
  // without one.
  at::NoGradGuard ng;
  CHECK(at::equal(y.detach(), at::linear(x.detach(), w.detach())));
  CHECK(at::equal(models::linear(x.detach(), w.detach(), false), at::linear(x.detach(), w.detach())));
  const auto xh = x.detach().to(at::kHalf), wh = w.detach().to(at::kHalf);
  CHECK(at::equal(models::linear(xh, wh, true), at::linear(xh, wh)));
}

namespace {

// Small integers as bfloat16: exact, and so is every float32 sum of their products here, so that
// a product rounded once to bfloat16 has one right answer whatever the order of its sums.
at::Tensor small_integers(at::IntArrayRef sizes, int64_t spread) {
  return at::randint(-spread, spread + 1, sizes).to(at::kBFloat16);
}

}  // namespace

TEST_CASE(
    "linear: bfloat16 through MKL's bfloat16 kernel, each result the float32 product rounded once, values "
    "and gradients") {
  const bool available = models::bf16_matmul_available();
  MESSAGE("MKL's bfloat16 products in this process: "
          << std::string(available ? "yes" : "no (ATen's instead)")
          << "; preferred by the model: " << std::string(models::bf16_matmul_preferred() ? "yes" : "no"));
  at::manual_seed(8);
  // Exact: the float64 product rounded to bfloat16 (float32 holds it exactly), forward and both
  // gradients; x laid out transposed in memory, as a view of another product's output may be.
  const auto xt = small_integers({96, 150}, 3).t();
  const auto x = xt.clone().requires_grad_();
  const auto w = small_integers({40, 96}, 2).requires_grad_();
  const auto exact = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  const auto y = models::linear(x, w, true);
  CHECK((y.scalar_type() == at::kBFloat16));
  CHECK(at::equal(y, exact(at::mm(x.detach().to(at::kDouble), w.detach().to(at::kDouble).t()))));
  CHECK(at::equal(models::linear(xt, w.detach(), true), y.detach()));
  const auto g = small_integers({150, 40}, 2);
  y.backward(g);
  CHECK((x.grad().scalar_type() == at::kBFloat16));
  CHECK(at::equal(x.grad(), exact(at::mm(g.to(at::kDouble), w.detach().to(at::kDouble)))));
  CHECK(at::equal(w.grad(), exact(at::mm(g.to(at::kDouble).t(), x.detach().to(at::kDouble)))));

  // Random values, [B, T, in]: within bfloat16's rounding of each result (2^-8 of it) plus
  // float32's of the sum, against float64 on the same bfloat16 values.
  const auto xr = at::randn({3, 50, 96}).to(at::kBFloat16).requires_grad_();
  const auto wr = (at::randn({40, 96}) * 0.1).to(at::kBFloat16).requires_grad_();
  const auto yr = models::linear(xr, wr, true);
  const auto [xd, xa] = references(xr);
  const auto [wd, wa] = references(wr);
  const auto yd = at::linear(xd, wd), ya = at::linear(xa, wa);
  CHECK(
      ((yr.to(at::kDouble) - yd).abs() / (yd.abs() * (1.0 / 256) + ya * 1e-5 + 1e-30)).max().item<double>() <=
      1.0);
  const auto gr = at::randn({3, 50, 40}).to(at::kBFloat16);
  yr.backward(gr);
  yd.backward(gr.to(at::kDouble));
  ya.backward(gr.to(at::kDouble).abs());
  CHECK(((xr.grad().to(at::kDouble) - xd.grad()).abs() /
         (xd.grad().abs() * (1.0 / 256) + xa.grad() * 1e-5 + 1e-30))
            .max()
            .item<double>() <= 1.0);
  CHECK(((wr.grad().to(at::kDouble) - wd.grad()).abs() /
         (wd.grad().abs() * (1.0 / 256) + wa.grad() * 1e-5 + 1e-30))
            .max()
            .item<double>() <= 1.0);

  // The route: MKL's bits where it runs, ATen's otherwise and with own = false.
  at::NoGradGuard ng;
  const auto rows = xr.detach().reshape({-1, 96});
  if (available) {
    REQUIRE((&cblas_gemm_bf16bf16f32 != nullptr));
    auto direct = at::empty({150, 40});
    cblas_gemm_bf16bf16f32(101, 111, 112, 150, 40, 96, 1.0f,
                           reinterpret_cast<const uint16_t*>(rows.const_data_ptr()), 96,
                           reinterpret_cast<const uint16_t*>(wr.detach().const_data_ptr()), 96, 0.0f,
                           direct.data_ptr<float>(), 40);
    CHECK(at::equal(yr.detach().reshape({-1, 40}), direct.to(at::kBFloat16)));
  } else {
    CHECK(at::equal(yr.detach(), at::linear(xr.detach(), wr.detach())));
  }
  CHECK(at::equal(models::linear(xr.detach(), wr.detach(), false), at::linear(xr.detach(), wr.detach())));
}

TEST_CASE(
    "grouped_linear: bfloat16 through MKL's bfloat16 kernel: each group exact, empty groups and rows past "
    "the last end zero") {
  at::manual_seed(9);
  const std::vector<int64_t> sizes = {7, 100, 0, 300, 1};
  std::vector<int64_t> ends;
  int64_t rows = 0;
  for (auto s : sizes) ends.push_back(rows += s);
  rows += 9;
  const int64_t in = 48, out = 40, groups = static_cast<int64_t>(sizes.size());
  const auto x = small_integers({rows, in}, 3).requires_grad_();
  const auto w = small_integers({groups, out, in}, 2).requires_grad_();
  const auto y = models::grouped_linear(x, w, ends_tensor(ends), true);
  CHECK((y.scalar_type() == at::kBFloat16));
  const auto xd = x.detach().to(at::kDouble), wd = w.detach().to(at::kDouble);
  CHECK(at::equal(y, grouped_reference(xd, wd, ends).to(at::kBFloat16)));
  const auto g = small_integers({rows, out}, 2);
  y.backward(g);
  auto dx = at::zeros({rows, in}, at::kDouble);
  auto dw = at::zeros({groups, out, in}, at::kDouble);
  for (int64_t e = 0, begin = 0; e < groups; begin = ends[e], ++e) {
    const auto ge = g.narrow(0, begin, ends[e] - begin).to(at::kDouble);
    dx.narrow(0, begin, ends[e] - begin).copy_(at::mm(ge, wd[e]));
    dw[e].copy_(at::mm(ge.t(), xd.narrow(0, begin, ends[e] - begin)));
  }
  CHECK(at::equal(x.grad(), dx.to(at::kBFloat16)));  // zero past the last end
  CHECK(at::equal(w.grad(), dw.to(at::kBFloat16)));  // zero for the empty group
  CHECK(at::equal(w.grad()[2], at::zeros({out, in}, at::kBFloat16)));

  // A row's result depends only on its own operands: the same rows alone, or after another group.
  at::NoGradGuard ng;
  const auto xr = at::randn({700, 64}).to(at::kBFloat16);
  const auto wr = (at::randn({2, 96, 64}) * 0.1).to(at::kBFloat16);
  const auto all = models::grouped_linear(xr, wr.narrow(0, 1, 1), ends_tensor({700}), true);
  for (int64_t first : {0, 5, 100}) {
    for (int64_t n : {1, 17, 300, 700}) {
      CAPTURE(first);
      CAPTURE(n);
      const auto both = at::cat({at::randn({first, 64}).to(at::kBFloat16), xr.narrow(0, 0, n)});
      const auto yr = models::grouped_linear(both, wr, ends_tensor({first, first + n}), true);
      CHECK(at::equal(yr.narrow(0, first, n), all.narrow(0, 0, n)));
    }
  }
}

TEST_CASE("grouped_linear: each group's rows by its own weight; empty groups and rows past the last end") {
  at::manual_seed(4);
  // Groups of several sizes, one of them empty; then 9 rows past the last end.
  const std::vector<int64_t> sizes = {7, 100, 128, 0, 100, 700, 1030};
  std::vector<int64_t> ends;
  int64_t rows = 0;
  for (auto s : sizes) ends.push_back(rows += s);
  rows += 9;
  const int64_t in = 48, out = 40, groups = static_cast<int64_t>(sizes.size());
  const auto x = at::randn({rows, in}).requires_grad_();
  const auto w = (at::randn({groups, out, in}) * 0.1).requires_grad_();
  const auto y = models::grouped_linear(x, w, ends_tensor(ends), true);
  const auto [xd, xa] = references(x);
  const auto [wd, wa] = references(w);
  const auto yd = grouped_reference(xd, wd, ends), ya = grouped_reference(xa, wa, ends);
  CHECK(scaled_error(y, yd, ya) < 1e-5);
  CHECK(at::equal(y.narrow(0, ends.back(), 9), at::zeros({9, out})));

  const auto g = at::randn({rows, out});
  y.backward(g);
  yd.backward(g.to(at::kDouble));
  ya.backward(g.to(at::kDouble).abs());
  CHECK(scaled_error(x.grad(), xd.grad(), xa.grad()) < 1e-5);
  CHECK(scaled_error(w.grad(), wd.grad(), wa.grad()) < 1e-5);
  CHECK(at::equal(w.grad()[3], at::zeros({out, in})));  // the empty group
  CHECK(at::equal(x.grad().narrow(0, ends.back(), 9), at::zeros({9, in})));

  // ATen's grouped product agrees on the grouped rows.
  at::NoGradGuard ng;
  const auto aten = models::grouped_linear(x.detach(), w.detach(), ends_tensor(ends), false);
  const auto grouped = at::indexing::Slice(0, ends.back());
  CHECK(scaled_error(aten.index({grouped}), yd.index({grouped}), ya.index({grouped})) < 1e-5);
}

TEST_CASE("grouped_linear: on ATen's product too, rows past the last end are zero, values and x's gradient") {
  // at::_grouped_mm leaves those rows unwritten (whatever the memory held: zeros in one call, old
  // values in the next), so each round makes and frees tensors of the same size first.
  at::manual_seed(7);
  const std::vector<int64_t> ends = {5, 5, 1200};
  const int64_t rows = 2000, in = 8, out = 16;
  const auto w = (at::randn({3, out, in}) * 0.1).requires_grad_();
  for (int round = 0; round < 4; ++round) {
    CAPTURE(round);
    { const auto litter = at::full({rows, out}, 7.0f) + at::full({rows, in}, 3.0f).sum(); }
    const auto x = at::randn({rows, in}).requires_grad_();
    const auto y = models::grouped_linear(x, w, ends_tensor(ends), false);
    CHECK(at::equal(y.narrow(0, 1200, rows - 1200), at::zeros({rows - 1200, out})));
    const auto [xd, xa] = references(x);
    const auto [wd, wa] = references(w);
    const auto yd = grouped_reference(xd, wd, ends), ya = grouped_reference(xa, wa, ends);
    CHECK(scaled_error(y, yd, ya) < 1e-5);
    w.mutable_grad() = at::Tensor();
    const auto g = at::randn({rows, out});
    y.backward(g);
    yd.backward(g.to(at::kDouble));
    ya.backward(g.to(at::kDouble).abs());
    CHECK(at::equal(x.grad().narrow(0, 1200, rows - 1200), at::zeros({rows - 1200, in})));
    CHECK(scaled_error(x.grad(), xd.grad(), xa.grad()) < 1e-5);
    CHECK(scaled_error(w.grad(), wd.grad(), wa.grad()) < 1e-5);
  }
  // No rows in any group: zeros.
  CHECK(at::equal(models::grouped_linear(at::randn({6, in}), w.detach(), ends_tensor({0, 0, 0}), false),
                  at::zeros({6, out})));
}

TEST_CASE(
    "grouped_linear: on ATen's route, rows not a multiple of 16 bytes (which at::_grouped_mm refuses) take a "
    "product per group") {
  // float32 rows of 6 and 10 values, bfloat16 rows of 12 and 20: 24, 40 bytes; a weight's row too.
  at::manual_seed(10);
  const std::vector<int64_t> ends = {3, 3, 40};
  for (const auto& [dtype, in, out] : std::vector<std::tuple<at::ScalarType, int64_t, int64_t>>{
           {at::kFloat, 6, 10}, {at::kFloat, 8, 10}, {at::kBFloat16, 12, 20}, {at::kBFloat16, 16, 12}}) {
    CAPTURE(dtype);
    CAPTURE(in);
    const auto x = at::randn({45, in}).to(dtype).requires_grad_();
    const auto w = (at::randn({3, out, in}) * 0.1).to(dtype).requires_grad_();
    const auto y = models::grouped_linear(x, w, ends_tensor(ends), false);
    const auto [xd, xa] = references(x);
    const auto [wd, wa] = references(w);
    const auto yd = grouped_reference(xd, wd, ends), ya = grouped_reference(xa, wa, ends);
    const double bound = dtype == at::kFloat ? 1e-5 : 1e-2;
    CHECK(scaled_error(y, yd, ya) < bound);
    CHECK(at::equal(y.narrow(0, 40, 5), at::zeros({5, out}, dtype)));
    const auto g = at::randn({45, out}).to(dtype);
    y.backward(g);
    yd.backward(g.to(at::kDouble));
    ya.backward(g.to(at::kDouble).abs());
    CHECK(scaled_error(x.grad(), xd.grad(), xa.grad()) < bound);
    CHECK(scaled_error(w.grad(), wd.grad(), wa.grad()) < bound);
    CHECK(at::equal(x.grad().narrow(0, 40, 5), at::zeros({5, in}, dtype)));
  }
}

TEST_CASE("grouped_linear: ends of the wrong length, decreasing or past the rows are refused, naming them") {
  const auto x = at::randn({10, 8});
  const auto w = at::randn({3, 4, 8});
  CHECK_THROWS_WITH_AS(models::grouped_linear(x, w, ends_tensor({4, 10}), true),
                       doctest::Contains("ends must be [3]"), c10::Error);
  CHECK_THROWS_WITH_AS(models::grouped_linear(x, w, ends_tensor({4, 3, 10}), true),
                       doctest::Contains("ends[1] = 3 after 4"), c10::Error);
  CHECK_THROWS_WITH_AS(models::grouped_linear(x, w, ends_tensor({4, 6, 11}), true),
                       doctest::Contains("at most 10 (the rows of x)"), c10::Error);
  CHECK_THROWS_WITH_AS(
      models::linear(x, at::randn({4, 9}), true),
      doctest::Contains("linear: x [..., in] and weight [out, in] expected, got x [10, 8] and weight [4, 9]"),
      c10::Error);
}
