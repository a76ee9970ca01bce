// The model's float32 products through oneDNN (models/matmul.hpp): values and gradients against
// float64, the route taken, grouped rows (empty groups, rows past the last end, every block path),
// and bad group ends.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fsdpp/models/matmul.hpp"

// What models::linear calls on the CPU (LibTorch exports it without declaring it); the tests call
// it directly to tell which route a product took.
namespace at::native {
[[gnu::weak]] void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result, float beta,
                                 float alpha);
}  // namespace at::native

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
      out.narrow(0, begin, ends[g] - begin).copy_(at::mm(x.narrow(0, begin, ends[g] - begin).to(at::kDouble), w[g].to(at::kDouble).t()));
  return out;
}

at::Tensor ends_tensor(const std::vector<int64_t>& ends) {
  return at::tensor(ends, at::kLong).to(at::kInt);
}

}  // namespace

TEST_CASE("linear: float32 products agree with float64, values and both gradients, and go through oneDNN where it runs") {
  const std::string route = models::onednn_matmul_available() ? "yes" : "no (ATen's instead)";
  MESSAGE("oneDNN float32 products in this process: " << route);
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

  // The route: oneDNN's bits where it runs, ATen's otherwise and with onednn = false.
  at::NoGradGuard ng;
  const auto rows = x.detach().reshape({-1, 96});
  if (models::onednn_matmul_available()) {
    auto direct = at::empty({150, 40});
    at::native::mkldnn_matmul(rows, w.detach().t(), direct, 0.0f, 1.0f);
    CHECK(at::equal(y.detach().reshape({-1, 40}), direct));
  } else {
    CHECK(at::equal(y.detach(), at::linear(x.detach(), w.detach())));
  }
  CHECK(at::equal(models::linear(x.detach(), w.detach(), false), at::linear(x.detach(), w.detach())));
  // Another dtype is ATen's product whatever `onednn` says.
  const auto xb = x.detach().to(at::kBFloat16), wb = w.detach().to(at::kBFloat16);
  CHECK(at::equal(models::linear(xb, wb, true), at::linear(xb, wb)));
}

TEST_CASE("grouped_linear: each group's rows by its own weight; empty groups, rows past the last end, every way rows are split") {
  at::manual_seed(4);
  // Group sizes: fewer rows than one row step with no rows before them (one call of their own
  // shape; ATen sums their weight gradient), more with too few rows before them to round up (a
  // last call overlapping the first), an exact multiple of the step, an empty group, and
  // multiples with a remainder (one call of the rows rounded up, reaching back into the groups
  // before; the remainder's weight gradient added by ATen); then 9 rows past the last end.
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
  CHECK(at::equal(models::grouped_linear(at::randn({6, in}), w.detach(), ends_tensor({0, 0, 0}), false), at::zeros({6, out})));
}

TEST_CASE("grouped_linear: a row's result does not depend on how many rows its group has, nor on the groups before it") {
  // Groups of different sizes run in calls of different row counts, overlapping differently at
  // their ends or reaching back into the group before; a row computed twice must get one value,
  // and the same whatever surrounds it.
  at::manual_seed(5);
  const auto x = at::randn({1000, 64});
  const auto w = at::randn({1, 96, 64}) * 0.1;
  const auto all = models::grouped_linear(x, w, ends_tensor({1000}), true);
  for (int64_t n : {16, 17, 300, 700, 999}) {
    CAPTURE(n);
    const auto part = models::grouped_linear(x.narrow(0, 0, n), w, ends_tensor({n}), true);
    CHECK(at::equal(part, all.narrow(0, 0, n)));
  }
  // The same rows as the second of two groups, after a first group of another weight.
  const auto w2 = at::cat({at::randn({1, 96, 64}), w});
  for (int64_t first : {5, 64, 100, 250}) {
    for (int64_t n : {17, 300, 700}) {
      CAPTURE(first);
      CAPTURE(n);
      const auto rows = at::cat({at::randn({first, 64}), x.narrow(0, 0, n)});
      const auto y = models::grouped_linear(rows, w2, ends_tensor({first, first + n}), true);
      CHECK(at::equal(y.narrow(0, first, n), all.narrow(0, 0, n)));
      CHECK(at::equal(y.narrow(0, 0, first), models::grouped_linear(rows.narrow(0, 0, first), w2.narrow(0, 0, 1),
                                                                    ends_tensor({first}), true)));
    }
  }
}

TEST_CASE("grouped_linear: ends of the wrong length, decreasing or past the rows are refused, naming them") {
  const auto x = at::randn({10, 8});
  const auto w = at::randn({3, 4, 8});
  CHECK_THROWS_WITH_AS(models::grouped_linear(x, w, ends_tensor({4, 10}), true), doctest::Contains("ends must be [3]"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(models::grouped_linear(x, w, ends_tensor({4, 3, 10}), true),
                       doctest::Contains("ends[1] = 3 after 4"), c10::Error);
  CHECK_THROWS_WITH_AS(models::grouped_linear(x, w, ends_tensor({4, 6, 11}), true),
                       doctest::Contains("at most 10 (the rows of x)"), c10::Error);
  CHECK_THROWS_WITH_AS(models::linear(x, at::randn({4, 9}), true), doctest::Contains("linear: x [..., in] and weight [out, in] expected, got x [10, 8] and weight [4, 9]"),
                       c10::Error);
}
