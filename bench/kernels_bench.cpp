// The model's elementwise kernels (models/cpu/kernels.hpp) against the ATen compositions they stand
// for, forward and backward, at moe-small's shapes (one dp 1 step's 32 x 128 tokens; the dense
// SwiGLU's hidden 384), side by side (interleaved rounds, medians), one thread unless --threads:
//   rms_norm-aten, rms_norm-fused   [rows, 128], weight [128]
//   residual-aten, residual-fused    a block's residual stream: x + r and its RMSNorm, both outputs
//                                    given gradients: ATen's add, rms_norm's kernel and autograd's
//                                    sum of the two gradients (the model before), against
//                                    models::residual_rms_norm
//   swiglu-aten, swiglu-fused        silu(a) * b, a and b [rows, 384]
//   rotary-aten, rotary-fused        q and k of the attention's projection [rows / 128, 128, 3, 4, 32]
//                                    rotated (models::rotary_reference, models::rotary_qkv)
//   router-aten, router-fused        the router's softmax, top 2 of 4 (normalised) and logsumexp on
//                                    [rows, 4] logits, every output used (models::softmax_top_k)
//   moe_rows-aten, moe_rows-fused    dropless routing's rows around the experts, [rows, 128] to
//                                    [rows * 2, 128] and back weighted (4 experts, top 2): at::sort,
//                                    index_select, a multiply and index_add into zeros, against
//                                    models::sort_by_expert, dispatch_rows and combine_rows
//   fsdpp_kernels_bench [--threads N] [--rounds R] [--rows N] [--bf16 1]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fsdpp/models/cpu/kernels.hpp"
#include "interleaved.hpp"
#include "options.hpp"

using namespace fsdpp;

int main(int argc, char** argv) {
  int64_t threads = 1, rounds = 7, rows = 32 * 128, bf16_flag = 0;
  if (!bench::parse_options(
          argc, argv, "kernels_bench",
          {{"threads", &threads}, {"rounds", &rounds}, {"rows", &rows}, {"bf16", &bf16_flag}}))
    return 2;
  const bool bf16 = bf16_flag != 0;
  at::set_num_threads(int(threads));
  const int64_t dim = 128, hidden = 384;  // moe-small
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  at::manual_seed(0);
  const auto x = at::randn({rows, dim}).to(dtype).requires_grad_();
  const auto w = (1 + 0.1 * at::randn({dim})).requires_grad_();
  const auto r = at::randn({rows, dim}).to(dtype).requires_grad_(), gs = at::randn({rows, dim}).to(dtype);
  const auto a = at::randn({rows, hidden}).to(dtype).requires_grad_(),
             b = at::randn({rows, hidden}).to(dtype).requires_grad_();
  const auto gx = at::randn({rows, dim}).to(dtype), gh = at::randn({rows, hidden}).to(dtype);
  auto residual_backward = [&](const at::Tensor& sum, const at::Tensor& y) {
    torch::autograd::backward({sum, y}, {gs, gx});
  };
  // The attention's projection [B, T, 3, H, D] at sequence length 128, 4 heads of 32; the
  // gradients come back [B, H, T, D] laid out [B, T, H, D], as the attention kernel gives them.
  const int64_t seq = 128, heads = 4, hd = dim / heads, batch = std::max<int64_t>(1, rows / seq);
  const auto qkv = at::randn({batch, seq, 3, heads, hd}).to(dtype).requires_grad_();
  const auto [cos, sin] = models::rotary_tables(seq, hd, 10000.0, at::TensorOptions().dtype(dtype));
  std::vector<at::Tensor> gqkv;
  for (int i = 0; i < 3; ++i)
    gqkv.push_back(at::randn({batch, seq, heads, hd}).to(dtype).permute({0, 2, 1, 3}));
  auto rotary_backward = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    torch::autograd::backward({q, k, v}, gqkv);
  };
  // Dropless routing of `rows` tokens to 4 experts, top 2.
  const int64_t experts = 4, top_k = 2;
  const auto choices = std::get<1>(at::topk(at::randn({rows, experts}), top_k, -1));
  const auto xm = at::randn({rows, dim}).to(dtype).requires_grad_();
  const auto wm = at::rand({rows, top_k}).to(dtype).requires_grad_();
  const auto gm = at::randn({rows, dim}).to(dtype);
  const auto logits = at::randn({rows, experts}).to(dtype).requires_grad_();
  const auto g_scores = at::randn({rows, experts}).to(dtype), g_weights = at::randn({rows, top_k}).to(dtype);
  auto router_backward = [&](const models::RouterTopK& r) {
    ((r.scores * g_scores).sum() + r.lse.pow(2).mean() + (r.weights * g_weights).sum()).backward();
  };
  std::map<std::string, std::function<void()>> ways = {
      {"rms_norm-aten", [&] { models::rms_norm_reference(x, w, 1e-5).backward(gx); }},
      {"rms_norm-fused", [&] { models::rms_norm(x, w, 1e-5).backward(gx); }},
      {"residual-aten",
       [&] {
         const auto sum = x + r;
         residual_backward(sum, models::rms_norm(sum, w, 1e-5));
       }},
      {"residual-fused",
       [&] {
         const auto [sum, y] = models::residual_rms_norm(x, r, w, 1e-5);
         residual_backward(sum, y);
       }},
      {"swiglu-aten", [&] { models::swiglu_reference(a, b).backward(gh); }},
      {"swiglu-fused", [&] { models::swiglu(a, b).backward(gh); }},
      {"rotary-aten",
       [&] {
         const auto parts = qkv.permute({2, 0, 3, 1, 4});
         rotary_backward(models::rotary_reference(parts[0], cos, sin),
                         models::rotary_reference(parts[1], cos, sin), parts[2]);
       }},
      {"rotary-fused",
       [&] {
         const auto [q, k, v] = models::rotary_qkv(qkv, cos, sin);
         rotary_backward(q, k, v);
       }},
      {"router-aten", [&] { router_backward(models::softmax_top_k_reference(logits, top_k, true)); }},
      {"router-fused", [&] { router_backward(models::softmax_top_k(logits, top_k, true)); }},
      {"moe_rows-aten",
       [&] {
         const auto flat = choices.reshape(-1);
         models::ExpertOrder o;
         o.top_k = top_k;
         o.order = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
         o.counts = at::zeros({experts}, flat.options()).scatter_add_(0, flat, at::ones_like(flat));
         models::combine_rows_reference(models::dispatch_rows_reference(xm, o), wm, o).backward(gm);
       }},
      {"moe_rows-fused",
       [&] {
         const auto o = models::sort_by_expert(choices, experts);
         models::combine_rows(models::dispatch_rows(xm, o), wm, o).backward(gm);
       }},
  };
  const std::vector<std::string> order = {"rms_norm-aten",  "rms_norm-fused", "residual-aten",
                                          "residual-fused", "swiglu-aten",    "swiglu-fused",
                                          "rotary-aten",    "rotary-fused",   "router-aten",
                                          "router-fused",   "moe_rows-aten",  "moe_rows-fused"};
  auto call = [&](const std::string& way) {
    for (const auto* t : {&x, &w, &r, &a, &b, &qkv, &xm, &wm, &logits})
      const_cast<at::Tensor&>(*t).mutable_grad() = at::Tensor();
    ways[way]();
  };
  const auto t = bench::interleave(order, call, int(rounds), /*per_round=*/10);
  for (const auto& way : order) {
    const auto kernel = way.substr(0, way.find('-'));
    fmt::print(
        "RESULT kernels way={} rows={} dtype={} threads={} fwd_bwd_ms={:.3f} speedup_over_aten={:.2f}\n", way,
        rows, bf16 ? "bfloat16" : "float32", threads, t.median_ms(way), t.ratio(kernel + "-aten", way));
  }
  return 0;
}
