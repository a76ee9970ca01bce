// The attention core of the MoE model at moe-small's shape, forward and backward, five ways side
// by side (interleaved rounds, medians), one thread unless --threads says otherwise:
//   composed    rotary by ATen operations, scores written out: softmax(q k^T / sqrt(hd) + mask) v
//   sdpa        rotary by ATen operations, at::scaled_dot_product_attention(is_causal)
//   fused-sdpa  models::rotary_qkv (one pass over q, k and v) and scaled_dot_product_attention
//   fused       models::rotary_qkv and models::causal_attention
//   one-pass    models::rotary_causal_attention: the two in one kernel, the model's path
//   rotary-aten, rotary-fused   the rotation alone, each way
//   fsdpp_attention_bench [--threads N] [--rounds R] [--batch B] [--seq T]
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "fsdpp/models/moe.hpp"
#include "interleaved.hpp"
#include "options.hpp"

using namespace fsdpp;

int main(int argc, char** argv) {
  int64_t threads = 1, rounds = 7, B = 16, T = 128;
  if (!bench::parse_options(argc, argv, "attention_bench",
                            {{"threads", &threads}, {"rounds", &rounds}, {"batch", &B}, {"seq", &T}}))
    return 2;
  at::set_num_threads(int(threads));
  const int64_t D = 128, H = 4, hd = D / H;  // moe-small
  at::manual_seed(0);
  const auto qkv = at::randn({B, T, 3, H, hd}).requires_grad_();
  const auto [cos, sin] = models::rotary_tables(T, hd, 10000.0, at::TensorOptions().dtype(at::kFloat));
  const auto grad = at::randn({B, H, T, hd});
  const auto mask = at::ones({T, T}, at::kBool).triu(1);

  auto aten_qkv = [&] {
    const auto p = qkv.permute({2, 0, 3, 1, 4});
    return std::tuple{models::rotary_reference(p[0], cos, sin), models::rotary_reference(p[1], cos, sin),
                      p[2]};
  };
  std::map<std::string, std::function<at::Tensor()>> ways = {
      {"composed",
       [&] {
         const auto [q, k, v] = aten_qkv();
         auto s = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
         s = at::softmax(s.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
         return at::matmul(s, v);
       }},
      {"sdpa",
       [&] {
         const auto [q, k, v] = aten_qkv();
         return at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
       }},
      {"rotary-aten",  // the rotation alone (q + k carries both gradients)
       [&] {
         const auto [q, k, v] = aten_qkv();
         return q + k;
       }},
      {"rotary-fused",
       [&] {
         const auto [q, k, v] = models::rotary_qkv(qkv, cos, sin);
         return q + k;
       }},
      {"fused-sdpa",
       [&] {
         const auto [q, k, v] = models::rotary_qkv(qkv, cos, sin);
         return at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
       }},
      {"fused",
       [&] {
         const auto [q, k, v] = models::rotary_qkv(qkv, cos, sin);
         return models::causal_attention(q, k, v);
       }},
      {"one-pass", [&] { return models::rotary_causal_attention(qkv, cos, sin); }},
  };
  const std::vector<std::string> order = {"composed",    "sdpa",         "fused-sdpa", "fused",
                                          "rotary-aten", "rotary-fused", "one-pass"};
  auto step = [&](const std::string& way) {
    qkv.mutable_grad() = at::Tensor();
    ways[way]().backward(grad);
  };
  const auto t = bench::interleave(order, step, int(rounds), /*per_round=*/10);
  for (const auto& w : order)
    fmt::print(
        "RESULT attention way={} batch={} seq={} dim={} heads={} threads={} fwd_bwd_ms={:.2f} "
        "speedup_over_composed={:.2f}\n",
        w, B, T, D, H, threads, t.median_ms(w), t.ratio("composed", w));
  fmt::print("RESULT attention_kernel threads={} speedup_over_sdpa={:.2f}\n", threads,
             t.ratio("fused-sdpa", "fused"));
  fmt::print("RESULT one_pass threads={} speedup_over_fused={:.2f}\n", threads, t.ratio("fused", "one-pass"));
  return 0;
}
