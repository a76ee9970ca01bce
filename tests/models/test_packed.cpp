// Packed samples (several sequences in one row, positions restarting at each): the attention
// kernels against a float64 composition with the block-diagonal causal mask, and the model's logits
// against each sequence run on its own.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fsdpp/models/cpu/kernels.hpp"
#include "fsdpp/models/moe.hpp"

using namespace fsdpp;

namespace {

// Positions [B, T] of samples packed from the given sequence lengths (each sample's sum is T).
at::Tensor positions_of(const std::vector<std::vector<int64_t>>& lengths) {
  std::vector<int64_t> p;
  for (const auto& sample : lengths)
    for (const auto n : sample)
      for (int64_t t = 0; t < n; ++t) p.push_back(t);
  const auto B = int64_t(lengths.size());
  return at::tensor(p, at::kLong).view({B, -1});
}

// softmax(q k^T / sqrt(d) + mask) v in float64, key j visible from query i when
// starts[b, i] <= j <= i.
at::Tensor packed_attention_f64(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& starts) {
  const int64_t T = q.size(2);
  const auto keys = at::arange(T, at::kLong);
  const auto hidden =
      (keys.view({1, 1, T}) < starts.unsqueeze(-1)) | (keys.view({1, 1, T}) > keys.view({1, T, 1}));
  auto s = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)) / std::sqrt(double(q.size(3)));
  s = s.masked_fill(hidden.unsqueeze(1), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1), v.to(at::kDouble));
}

double worst(const at::Tensor& a, const at::Tensor& b, double floor) {
  const auto af = a.to(at::kDouble), bf = b.to(at::kDouble);
  return ((af - bf).abs() / (bf.abs() + floor)).max().item<double>();
}

// A small model: 4 heads of 8 over 2 layers, MoE (4 experts, top 2) unless `experts` is 0.
models::MoEConfig small_config(int64_t experts) {
  models::MoEConfig c;
  c.dim = 32;
  c.heads = 4;
  c.layers = 2;
  c.max_seq_len = 160;
  c.ffn_hidden = 48;
  c.experts = experts;
  c.top_k = 2;
  c.expert_hidden = 16;
  c.vocab_size = 64;
  return c;
}

// Sequences of one token, ones that cross the kernel's 64-row blocks, one that fills a sample.
const std::vector<std::vector<int64_t>> kLengths = {{1, 40, 70, 1, 38}, {150}, {64, 64, 22}};

}  // namespace

TEST_CASE("packed attention: each sequence sees only its own keys, values and gradients") {
  REQUIRE(models::causal_attention_available());
  at::manual_seed(31);
  const auto positions = positions_of(kLengths);
  const auto starts = models::sequence_starts(positions);
  const int64_t B = positions.size(0), T = positions.size(1), H = 2, D = 24;
  std::vector<at::Tensor> in, ref;
  for (int i = 0; i < 3; ++i) {
    const auto x = at::randn({B, H, T, D});
    in.push_back(x.clone().requires_grad_());
    ref.push_back(x.to(at::kDouble).requires_grad_());
  }
  const auto expected = packed_attention_f64(ref[0], ref[1], ref[2], starts);
  const auto g = at::randn({B, H, T, D});
  expected.backward(g.to(at::kDouble));
  const auto rms = expected.pow(2).mean().sqrt().item<double>();
  for (const bool kernel : {true, false}) {
    CAPTURE(kernel);
    for (auto& x : in) x.mutable_grad() = at::Tensor();
    const auto y = kernel ? models::causal_attention(in[0], in[1], in[2], starts)
                          : models::causal_attention_reference(in[0], in[1], in[2], starts);
    CHECK(worst(y, expected, rms) < 1e-5);
    y.backward(g);
    double floor = 0;
    for (int i = 0; i < 3; ++i) floor = std::max(floor, 1e-2 * ref[i].grad().abs().max().item<double>());
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(worst(in[i].grad(), ref[i].grad(), floor) < 1e-4);
    }
  }
  // Without the starts the same inputs attend across sequences: the check above can fail.
  CHECK(worst(models::causal_attention(in[0], in[1], in[2]), expected, rms) > 1e-2);
  // A start past its row is refused, naming it.
  auto bad = starts.clone();
  bad[0][5] = 6;
  CHECK_THROWS_WITH(models::causal_attention(in[0], in[1], in[2], bad), doctest::Contains("row 5"));
}

TEST_CASE("packed rotary attention: the one-pass kernel equals rotary_qkv and the masked reference") {
  REQUIRE(models::causal_attention_available());
  at::manual_seed(32);
  const auto positions = positions_of(kLengths);
  const int64_t B = positions.size(0), T = positions.size(1), H = 3, D = 16;
  const auto tables = models::rotary_at(models::rotary_tables(T, D, 10000.0, at::kFloat), positions);
  const auto starts = models::sequence_starts(positions);
  const auto qkv = at::randn({B, T, 3, H, D});
  const auto g = at::randn({B, H, T, D});
  auto run = [&](bool one_pass) {
    const auto x = qkv.clone().requires_grad_();
    at::Tensor y;
    if (one_pass) {
      y = models::rotary_causal_attention(x, tables.first, tables.second, starts);
    } else {
      const auto [q, k, v] = models::rotary_qkv(x, tables.first, tables.second);
      y = models::causal_attention_reference(q, k, v, starts);
    }
    y.backward(g);
    return std::pair{y.detach(), x.grad()};
  };
  const auto [y, grad] = run(true);
  const auto [y2, grad2] = run(false);
  CHECK(worst(y, y2, y2.pow(2).mean().sqrt().item<double>()) < 1e-5);
  CHECK(worst(grad, grad2, grad2.pow(2).mean().sqrt().item<double>()) < 1e-4);
}

TEST_CASE("packed model: each sequence's logits equal the sequence run alone") {
  auto c = small_config(4);
  c.kv_heads = 2;
  for (const bool fused : {true, false}) {
    CAPTURE(fused);
    c.fused_attention = fused;
    at::manual_seed(33);
    auto model = models::MoETransformer(c);
    at::NoGradGuard no_grad;
    const auto positions = positions_of(kLengths);
    const auto tokens = at::randint(c.vocab_size, positions.sizes(), at::kLong);
    model->set_positions(positions);
    const auto packed = model->forward(tokens);
    model->set_positions(at::Tensor());
    for (size_t b = 0; b < kLengths.size(); ++b) {
      int64_t o = 0;
      for (const auto n : kLengths[b]) {
        CAPTURE(b);
        CAPTURE(o);
        const auto alone = model->forward(tokens[int64_t(b)].narrow(0, o, n).unsqueeze(0))[0];
        const auto within = packed[int64_t(b)].narrow(0, o, n);
        CHECK(worst(within, alone, alone.abs().max().item<double>()) < 1e-5);
        o += n;
      }
    }
    // Unpacked, a later sequence sees the earlier ones: the comparison above can fail.
    const auto plain = model->forward(tokens);
    CHECK(worst(plain[0].narrow(0, 41, 70), packed[0].narrow(0, 41, 70), 1e-3) > 1e-3);
  }
}

TEST_CASE("packed model with the published families' attention: the CPU kernel equals the masked reference") {
  auto c = small_config(0);
  c.kv_heads = 2;
  c.head_size = 12;
  c.qk_norm = "head";
  c.qkv_bias = true;
  c.sliding_window = 40;
  c.rope_type = "llama3";
  c.rope_factor = 8;
  c.rope_original_max_seq_len = 32;
  const auto positions = positions_of(kLengths);
  const auto tokens = at::randint(c.vocab_size, positions.sizes(), at::kLong);
  std::vector<at::Tensor> logits, grads;
  for (const bool fused : {true, false}) {
    c.fused_attention = fused;
    at::manual_seed(34);
    auto model = models::MoETransformer(c);
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.normal_(0, 0.3);  // biases and norms away from 0 and 1
    }
    model->set_positions(positions);
    const auto y = model->forward(tokens);
    y.pow(2).mean().backward();
    logits.push_back(y.detach());
    grads.push_back(model->named_parameters()["layers.0.attn.qkv.weight"].grad());
  }
  CHECK(worst(logits[0], logits[1], logits[1].abs().max().item<double>()) < 1e-5);
  CHECK(worst(grads[0], grads[1], grads[1].abs().max().item<double>()) < 1e-4);
}

TEST_CASE("sliding window: a token's logits are those of the window's tokens alone") {
  // With rotary embeddings scores depend on positions' differences only, so the last token of a
  // window run on its own computes what it computes at any position of a longer sequence.
  auto c = small_config(0);
  c.sliding_window = 24;
  for (const bool fused : {true, false}) {
    CAPTURE(fused);
    c.fused_attention = fused;
    at::manual_seed(35);
    auto model = models::MoETransformer(c);
    at::NoGradGuard no_grad;
    const auto tokens = at::randint(c.vocab_size, {1, 150}, at::kLong);
    const auto whole = model->forward(tokens)[0];
    for (const int64_t i : {23, 24, 70, 149}) {
      CAPTURE(i);
      // Under one window (i = 23), and past it: the first W - 1 layers' windows reach further back
      // through the layers below, so the window alone must cover every layer's reach.
      const int64_t reach = std::min<int64_t>(i + 1, c.layers * (c.sliding_window - 1) + 1);
      const auto alone = model->forward(tokens.narrow(1, i + 1 - reach, reach))[0][reach - 1];
      CHECK(worst(whole[i], alone, alone.abs().max().item<double>()) < 1e-4);
    }
    // Without the window the same comparison fails: earlier tokens count.
    models::MoEConfig full = c;
    full.sliding_window = 0;
    at::manual_seed(35);
    auto unwindowed = models::MoETransformer(full);
    const auto all = unwindowed->forward(tokens)[0][149];
    const int64_t reach = c.layers * (c.sliding_window - 1) + 1;
    CHECK(worst(all, unwindowed->forward(tokens.narrow(1, 150 - reach, reach))[0][reach - 1], 1e-3) > 1e-3);
  }
}
