#include "fsdpp/models/matmul.hpp"

#include "fsdpp/base/mkl_dispatch.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <vector>

// LibTorch exports oneDNN's matrix product for dense tensors (result = beta result + alpha mat1
// mat2; 2-D or 3-D operands, contiguous or with the last two dimensions transposed) without
// declaring it in its installed headers. Weak: a LibTorch without it leaves this null.
namespace at::native {
[[gnu::weak]] void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result, float beta,
                                 float alpha);
}  // namespace at::native

namespace fsdpp::models {

namespace {

bool onednn_works() {
  if (&at::native::mkldnn_matmul == nullptr) return false;
  // Small integers: every product and sum is exact in float32 whatever the order, so the two
  // products must agree bit for bit. The second operand is transposed, as the model's weights are.
  const auto cpu = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  const auto a = at::arange(24 * 40, cpu).remainder_(7).sub_(3).reshape({24, 40});
  const auto w = at::arange(16 * 40, cpu).remainder_(5).sub_(2).reshape({16, 40});
  auto out = at::empty({24, 16}, cpu);
  try {
    at::native::mkldnn_matmul(a, w.t(), out, 0.0f, 1.0f);
  } catch (const c10::Error&) {
    return false;  // float32 refused: this CPU lacks the instructions its check asks for
  }
  return at::equal(out, at::mm(a, w.t()));
}

// out = a b, all float32 CPU tensors, out contiguous.
void product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  if (a.size(0) == 0 || b.size(1) == 0) return;
  if (a.size(1) == 0) {
    out.zero_();
    return;
  }
  at::native::mkldnn_matmul(a, b, out, 0.0f, 1.0f);
}

// oneDNN compiles a kernel for each new shape it meets (about a millisecond) and keeps the last
// thousand or so, and each call costs about 25 us before any arithmetic (against about 10 us for
// ATen's). The experts' row counts change every step, so their products run on row counts that are
// multiples of kRowStep, in as few calls as that allows: a few dozen shapes per product, all
// compiled within a run's first steps.
constexpr int64_t kRowStep = 64;

int64_t rounded_up(int64_t n) { return (n + kRowStep - 1) / kRowStep * kRowStep; }

// out = a b for a row count n that may not be a multiple of kRowStep (a [n, K], out [n, N]), without
// touching rows outside: the first n rounded down to a multiple of kRowStep rows in one call, and
// the last kRowStep rows in another, overlapping the first. Fewer than kRowStep rows: one call of
// their own shape. A row's result does not depend on how many rows the call has, nor on where in
// the call it is (tests/train/test_matmul.cpp), so the rows computed twice get one value, and every
// row the value it would have in any other call.
void product_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  const int64_t n = a.size(0), whole = n / kRowStep * kRowStep;
  if (whole == 0) return product(a, b, out);
  product(a.narrow(0, 0, whole), b, out.narrow(0, 0, whole));
  if (whole < n) product(a.narrow(0, n - kRowStep, kRowStep), b, out.narrow(0, n - kRowStep, kRowStep));
}

// out = a b_g on each group g's rows ([ends[g-1], ends[g]) of a and out; b_g = weight_of(g)), one
// call per group where it can: the group's row count rounded up to a multiple of kRowStep, in a
// window that ends where the group ends and so reaches back into earlier groups' rows. The groups
// go last to first, so each group writes its own rows after any later group's window has passed
// over them. A group with too few rows before its end for such a window takes product_rows.
template <typename WeightOf>
void grouped_products(const at::Tensor& a, WeightOf weight_of, const std::vector<int64_t>& ends, const at::Tensor& out) {
  for (auto g = static_cast<int64_t>(ends.size()) - 1; g >= 0; --g) {
    const int64_t begin = g > 0 ? ends[g - 1] : 0, end = ends[g], n = end - begin, window = rounded_up(n);
    if (n == 0) continue;
    if (window <= end)
      product(a.narrow(0, end - window, window), weight_of(g), out.narrow(0, end - window, window));
    else
      product_rows(a.narrow(0, begin, n), weight_of(g), out.narrow(0, begin, n));
  }
}

// out = a^T x summed over a varying row count n (a [n, M], x [n, N], out [M, N]): the first n
// rounded down to a multiple of kRowStep rows by oneDNN, the rest (fewer) added by ATen's product.
void product_over_rows(const at::Tensor& a, const at::Tensor& x, const at::Tensor& out) {
  const int64_t n = a.size(0), whole = n / kRowStep * kRowStep;
  if (whole > 0) product(a.narrow(0, 0, whole).t(), x.narrow(0, 0, whole), out);
  if (whole == n) {
    if (n == 0) out.zero_();
    return;
  }
  const auto rest_a = a.narrow(0, whole, n - whole).t(), rest_x = x.narrow(0, whole, n - whole);
  auto o = out;
  if (whole > 0)
    o.addmm_(rest_a, rest_x);
  else
    at::mm_out(o, rest_a, rest_x);
}

bool on_onednn(const at::Tensor& x, const at::Tensor& weight, bool onednn) {
  return onednn && x.is_cpu() && weight.is_cpu() && x.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kFloat && onednn_matmul_available();
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct OneDnnLinear : torch::autograd::Function<OneDnnLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    const auto rows = x.reshape({-1, x.size(-1)});
    auto out = at::empty({rows.size(0), weight.size(0)}, x.options());
    product(rows, weight.t(), out);
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return out.view(sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto g = grads[0].reshape({-1, weight.size(0)});
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      dx = at::empty({g.size(0), weight.size(1)}, g.options());
      product(g, weight, dx);
      dx = dx.view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      dw = at::empty(weight.sizes(), g.options());
      product(g.t(), x.reshape({-1, x.size(-1)}), dw);
    }
    return {dx, dw};
  }
};

struct OneDnnGroupedLinear : torch::autograd::Function<OneDnnGroupedLinear> {
  // Rows past the last group are zero, in the result and in x's gradient.
  static void zero_past_groups(const at::Tensor& t, const std::vector<int64_t>& ends) {
    const int64_t end = ends.empty() ? 0 : ends.back();
    t.narrow(0, end, t.size(0) - end).zero_();
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            std::vector<int64_t> ends) {
    ctx->save_for_backward({x, weight});
    auto out = at::empty({x.size(0), weight.size(1)}, x.options());
    grouped_products(x, [&](int64_t g) { return weight.select(0, g).t(); }, ends, out);
    zero_past_groups(out, ends);
    ctx->saved_data["ends"] = std::move(ends);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto ends = ctx->saved_data["ends"].toIntVector();
    const auto g = grads[0];
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      dx = at::empty(x.sizes(), g.options());
      grouped_products(g, [&](int64_t e) { return weight.select(0, e); }, ends, dx);
      zero_past_groups(dx, ends);
    }
    if (ctx->needs_input_grad(1)) {
      // Every group, empty ones too: product_over_rows writes zeros for no rows.
      dw = at::empty(weight.sizes(), g.options());
      for (int64_t e = 0, begin = 0; e < weight.size(0); begin = ends[e], ++e)
        product_over_rows(g.narrow(0, begin, ends[e] - begin), x.narrow(0, begin, ends[e] - begin), dw.select(0, e));
    }
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

std::vector<int64_t> detail::group_ends(const at::Tensor& ends, int64_t rows, int64_t groups, const char* what) {
  TORCH_CHECK(ends.dim() == 1 && ends.size(0) == groups, what, ": ends must be [", groups,
              "] (one per group of the weight), got ", ends.sizes());
  TORCH_CHECK(ends.is_cpu(), what, ": ends must be on the host for float32 CPU inputs, got ", ends.device());
  const auto e = ends.to(at::kLong).contiguous();
  std::vector<int64_t> out(e.const_data_ptr<int64_t>(), e.const_data_ptr<int64_t>() + groups);
  for (int64_t g = 0, prev = 0; g < groups; prev = out[g], ++g)
    TORCH_CHECK(out[g] >= prev && out[g] <= rows, what, ": ends must be non-decreasing and at most ", rows,
                " (the rows of x); ends[", g, "] = ", out[g], " after ", prev);
  return out;
}

bool onednn_matmul_available() {
  static const bool available = onednn_works();
  return available;
}

bool onednn_matmul_preferred() { return onednn_matmul_available() && !mkl_dispatch().by_instruction_set; }

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, bool onednn) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), "linear: x [..., in] and weight [out, in] expected, got x ",
              x.sizes(), " and weight ", weight.sizes());
  return on_onednn(x, weight, onednn) ? OneDnnLinear::apply(x, weight) : at::linear(x, weight);
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends, bool onednn) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2), "grouped_linear: x [rows, in] and weight [groups, out, in] expected, got x ",
              x.sizes(), " and weight ", weight.sizes());
  const bool dnnl = on_onednn(x, weight, onednn);
  if (dnnl || ends.is_cpu()) {  // (ends on a GPU are not read on the host)
    auto checked = detail::group_ends(ends, x.size(0), weight.size(0), "grouped_linear");
    if (dnnl) return OneDnnGroupedLinear::apply(x, weight, std::move(checked));
    // at::_grouped_mm leaves the rows past the last end unwritten, in its result and in x's
    // gradient (whatever the memory held): those rows are left out of it and given zeros here.
    const int64_t end = checked.empty() ? 0 : checked.back(), past = x.size(0) - end;
    if (past > 0) {
      const auto zeros = at::zeros({past, weight.size(1)}, x.options());
      if (end == 0) return zeros;  // no rows in any group: no product, no gradient
      return at::cat({at::_grouped_mm(x.narrow(0, 0, end), weight.transpose(1, 2), ends), zeros});
    }
  }
  return at::_grouped_mm(x, weight.transpose(1, 2), ends);
}

}  // namespace fsdpp::models
