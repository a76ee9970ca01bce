#include "fsdpp/models/cpu/matmul.hpp"

#include "fsdpp/base/mkl_dispatch.hpp"
#include "blas_gemm.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fsdpp::models {

namespace {

// A route's first product, on small integers: every product and sum is exact in float32 (and the
// values in bfloat16) whatever the order, so a route must give ATen's float32 product bit for bit.
// a [24, 40] and w [16, 40], float32; the product is a w^T, the second operand transposed as the
// model's weights are.
struct TrialProduct {
  // Made on the CPU by name: the first product may come inside a step that the device check
  // watches (include/fsdpp/base/device_check.hpp).
  at::TensorOptions cpu = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  at::Tensor a = at::arange(24 * 40, cpu).remainder_(7).sub_(3).reshape({24, 40});
  at::Tensor w = at::arange(16 * 40, cpu).remainder_(5).sub_(2).reshape({16, 40});
  at::Tensor out = at::empty({24, 16}, cpu);
  bool right() const { return at::equal(out, at::mm(a, w.t())); }
};

// bfloat16 products by MKL's bfloat16 kernel, called directly (Note [bfloat16 products on the CPU]).

// A 2-D bfloat16 operand as MKL takes it: its bits, whether it lies transposed in memory, and its
// leading dimension. A tensor laid out neither way is copied into `keep`.
struct Bf16Operand {
  const uint16_t* data;
  bool trans;
  int64_t ld;
};

Bf16Operand bf16_operand(const at::Tensor& t, at::Tensor& keep) {
  const auto bits = [](const at::Tensor& u) {
    return reinterpret_cast<const uint16_t*>(u.const_data_ptr<at::BFloat16>());
  };
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(1, cols)) return {bits(t), false, t.stride(0)};
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(1, rows)) return {bits(t), true, t.stride(1)};
  keep = t.contiguous();
  return {bits(keep), false, std::max<int64_t>(1, cols)};
}

// c = a b (float32 c [m, n] with unit column stride; bfloat16 a [m, k] and b [k, n]), every product
// and sum in float32.
void bf16_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    c.zero_();
    return;
  }
  at::Tensor keep_a, keep_b;
  const auto oa = bf16_operand(a, keep_a), ob = bf16_operand(b, keep_b);
  detail::gemm_bf16(oa.trans, ob.trans, m, n, k, 1.0f, oa.data, oa.ld, ob.data, ob.ld, 0.0f,
                    c.data_ptr<float>(), c.stride(0));
}

at::Tensor float32_like(const at::Tensor& t, at::IntArrayRef sizes) {
  return at::empty(sizes, t.options().dtype(at::kFloat));
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The route's 2-D product, a [m, k] times b [k, n] into a new bfloat16 tensor.
struct Bf16Route {  // the products into float32, each result rounded once to bfloat16
  static at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
    auto c = float32_like(a, {a.size(0), b.size(1)});
    bf16_product(a, b, c);
    return c.to(at::kBFloat16);
  }
};

// x W^T, and both gradients, by a route's products.
template <typename Route>
struct RouteLinear : torch::autograd::Function<RouteLinear<Route>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return Route::mm(x.reshape({-1, x.size(-1)}), weight.t()).view(sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto g = grads[0].reshape({-1, weight.size(0)});
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = Route::mm(g, weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = Route::mm(g.t(), x.reshape({-1, x.size(-1)}));
    return {dx, dw};
  }
};

// What a grouped product's backward reads back: x, the weight and the groups' ends.
struct GroupedInputs {
  at::Tensor x, weight;
  std::vector<int64_t> ends;
};

void save_grouped(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                  std::vector<int64_t> ends) {
  ctx->save_for_backward({x, weight});
  ctx->saved_data["ends"] = std::move(ends);
}

GroupedInputs saved_grouped(AutogradContext* ctx) {
  const auto saved = ctx->get_saved_variables();
  return {saved[0], saved[1], ctx->saved_data["ends"].toIntVector()};
}

// The rows past the last group, zero in a grouped product's result and in x's gradient.
void zero_past_groups(const at::Tensor& t, const std::vector<int64_t>& ends) {
  const int64_t end = ends.empty() ? 0 : ends.back();
  t.narrow(0, end, t.size(0) - end).zero_();
}

// One product per group of rows, as Bf16Route computes each; rows past the last group zero.
struct Bf16GroupedLinear : torch::autograd::Function<Bf16GroupedLinear> {
  template <typename WeightOf>
  static at::Tensor products(const at::Tensor& a, WeightOf weight_of, int64_t cols,
                             const std::vector<int64_t>& ends) {
    auto c = float32_like(a, {a.size(0), cols});
    for (int64_t g = 0, begin = 0; g < int64_t(ends.size()); begin = ends[g], ++g)
      bf16_product(a.narrow(0, begin, ends[g] - begin), weight_of(g), c.narrow(0, begin, ends[g] - begin));
    zero_past_groups(c, ends);
    return c.to(at::kBFloat16);
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            std::vector<int64_t> ends) {
    auto out = products(
        x, [&](int64_t g) { return weight.select(0, g).t(); }, weight.size(1), ends);
    save_grouped(ctx, x, weight, std::move(ends));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto [x, weight, ends] = saved_grouped(ctx);
    const auto g = grads[0];
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0))
      dx = products(
          g, [&](int64_t e) { return weight.select(0, e); }, weight.size(2), ends);
    if (ctx->needs_input_grad(1)) {
      // Every group, empty ones too: bf16_product writes zeros for no rows.
      auto c = float32_like(g, weight.sizes());
      for (int64_t e = 0, begin = 0; e < weight.size(0); begin = ends[e], ++e)
        bf16_product(g.narrow(0, begin, ends[e] - begin).t(), x.narrow(0, begin, ends[e] - begin),
                     c.select(0, e));
      dw = c.to(at::kBFloat16);
    }
    return {dx, dw, at::Tensor()};
  }
};

bool on_bf16_blas(const at::Tensor& x, const at::Tensor& weight, bool own) {
  return own && x.is_cpu() && weight.is_cpu() && x.scalar_type() == at::kBFloat16 &&
         weight.scalar_type() == at::kBFloat16 && bf16_matmul_available();
}

bool bf16_blas_works() {
  if (!detail::blas_bf16_available()) return false;
  TrialProduct trial;
  bf16_product(trial.a.to(at::kBFloat16), trial.w.to(at::kBFloat16).t(), trial.out);
  return trial.right();
}

// The CPU's bfloat16 dot products (AVX512_BF16), enabled by the OS with the rest of AVX-512.
bool cpu_has_bf16_instructions() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace

std::vector<int64_t> detail::group_ends(const at::Tensor& ends, int64_t rows, int64_t groups,
                                        const char* what) {
  TORCH_CHECK(ends.dim() == 1 && ends.size(0) == groups, what, ": ends must be [", groups,
              "] (one per group of the weight), got ", ends.sizes());
  TORCH_CHECK(ends.is_cpu(), what, ": ends must be on the host for CPU inputs, got ", ends.device());
  const auto e = ends.to(at::kLong).contiguous();
  std::vector<int64_t> out(e.const_data_ptr<int64_t>(), e.const_data_ptr<int64_t>() + groups);
  for (int64_t g = 0, prev = 0; g < groups; prev = out[g], ++g)
    TORCH_CHECK(out[g] >= prev && out[g] <= rows, what, ": ends must be non-decreasing and at most ", rows,
                " (the rows of x); ends[", g, "] = ", out[g], " after ", prev);
  return out;
}

bool bf16_matmul_available() {
  static const bool available = bf16_blas_works();
  return available;
}

bool bf16_matmul_preferred() {
  static const bool preferred =
      bf16_matmul_available() && cpu_has_bf16_instructions() && mkl_dispatch().by_instruction_set;
  return preferred;
}

bool own_products_preferred(at::ScalarType dtype) {
  return dtype == at::kBFloat16 && bf16_matmul_preferred();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, bool own) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "linear: x [..., in] and weight [out, in] expected, got x ", x.sizes(), " and weight ",
              weight.sizes());
  if (on_bf16_blas(x, weight, own)) return RouteLinear<Bf16Route>::apply(x, weight);
  return at::linear(x, weight);
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends, bool own) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2),
              "grouped_linear: x [rows, in] and weight [groups, out, in] expected, got x ", x.sizes(),
              " and weight ", weight.sizes());
  const bool bf16 = on_bf16_blas(x, weight, own);
  if (bf16 || ends.is_cpu()) {  // (ends on a GPU are not read on the host)
    auto checked = detail::group_ends(ends, x.size(0), weight.size(0), "grouped_linear");
    if (bf16) return Bf16GroupedLinear::apply(x, weight, std::move(checked));
    const int64_t end = checked.empty() ? 0 : checked.back(), past = x.size(0) - end;
    // at::_grouped_mm refuses rows that are not a multiple of 16 bytes apart (x's, the weight's and
    // the result's): there, one at::mm per group.
    const int64_t element_bytes = int64_t(x.element_size());
    if (x.is_cpu() && (x.size(1) * element_bytes % 16 != 0 || weight.size(1) * element_bytes % 16 != 0)) {
      std::vector<at::Tensor> pieces;
      for (int64_t g = 0, begin = 0; g < weight.size(0); begin = checked[g], ++g)
        if (checked[g] > begin)
          pieces.push_back(at::mm(x.narrow(0, begin, checked[g] - begin), weight[g].t()));
      if (past > 0) pieces.push_back(at::zeros({past, weight.size(1)}, x.options()));
      return pieces.empty() ? at::zeros({0, weight.size(1)}, x.options()) : at::cat(pieces);
    }
    // at::_grouped_mm leaves the rows past the last end unwritten, in its result and in x's
    // gradient (whatever the memory held): those rows are left out of it and given zeros here.
    if (past > 0) {
      const auto zeros = at::zeros({past, weight.size(1)}, x.options());
      if (end == 0) return zeros;  // no rows in any group: no product, no gradient
      return at::cat({at::_grouped_mm(x.narrow(0, 0, end), weight.transpose(1, 2), ends), zeros});
    }
  }
  return at::_grouped_mm(x, weight.transpose(1, 2), ends);
}

}  // namespace fsdpp::models
