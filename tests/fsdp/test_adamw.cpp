// fsdp::AdamW: the update of LibTorch's AdamW, with the learning rate and step count in tensors.
#include <torch/optim/adamw.h>

#include "fsdpp/fsdp/adamw.hpp"
#include "fsdp/models.hpp"

using namespace fsdpp;

namespace {

// Parameters a matrix (decayed) and a vector (not), with gradients of a fixed sequence.
struct Pair {
  at::Tensor w, b;
};

Pair make_params() {
  auto g = at::detail::createCPUGenerator(3);
  return {at::randn({6, 4}, g).requires_grad_(), at::randn({4}, g).requires_grad_()};
}

at::Tensor grad_for(int step, at::IntArrayRef shape) {
  auto g = at::detail::createCPUGenerator(100 + step);
  return at::randn(shape, g) * (step % 3 + 1);
}

}  // namespace

TEST_CASE("AdamW: 20 steps with a changing learning rate match LibTorch's AdamW") {
  const double wd = 0.1, lrs[] = {1e-2, 3e-3, 5e-2};
  auto ours = make_params(), theirs = make_params();
  fsdp::AdamW opt({ours.w}, {.lr = lrs[0], .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = wd},
                  {ours.b});
  auto o = torch::optim::AdamWOptions(lrs[0]).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{theirs.w}, std::make_unique<torch::optim::AdamWOptions>(o));
  auto nd = std::make_unique<torch::optim::AdamWOptions>(o);
  nd->weight_decay(0);
  groups.emplace_back(std::vector<at::Tensor>{theirs.b}, std::move(nd));
  torch::optim::AdamW ref(std::move(groups), o);

  const void* m_addr = opt.state(ours.w)->exp_avg.data_ptr();
  for (int s = 0; s < 20; ++s) {
    const double lr = lrs[s % 3];
    opt.set_lr(lr);
    for (auto& g : ref.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    for (auto* p : {&ours.w, &ours.b, &theirs.w, &theirs.b}) p->mutable_grad() = grad_for(s, p->sizes());
    opt.step();
    ref.step();
    INFO("step " << s);
    CHECK(test::rel_diff(ours.w, theirs.w) < 1e-6);
    CHECK(test::rel_diff(ours.b, theirs.b) < 1e-6);
  }
  CHECK(opt.steps() == 20);
  CHECK(opt.state(ours.w)->exp_avg.data_ptr() == m_addr);
  CHECK(opt.state(at::zeros({1})) == nullptr);
}

TEST_CASE("AdamW: a gradient in another dtype or layout updates as its dense, parameter-dtype copy would") {
  // The fused CPU update reads dense gradients of the parameter's dtype; others are converted.
  auto odd = make_params(), plain = make_params();
  const fsdp::AdamWOptions o{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  fsdp::AdamW a({odd.w}, o, {odd.b}), b({plain.w}, o, {plain.b});
  for (int s = 0; s < 5; ++s) {
    const auto gw = grad_for(s, {4, 6}).t();             // strided
    const auto gb = grad_for(s, {4}).to(at::kBFloat16);  // bfloat16
    REQUIRE(!gw.is_contiguous());
    odd.w.mutable_grad() = gw;
    odd.b.mutable_grad() = gb;
    plain.w.mutable_grad() = gw.contiguous();
    plain.b.mutable_grad() = gb.to(at::kFloat);
    a.step();
    b.step();
  }
  CHECK(at::equal(odd.w, plain.w));
  CHECK(at::equal(odd.b, plain.b));
  CHECK(!at::equal(odd.w, make_params().w));  // and it did update
}

TEST_CASE(
    "AdamW: weight decay reaches only the decayed group; a parameter without a gradient is left alone") {
  auto p = make_params();
  const auto w0 = p.w.detach().clone(), b0 = p.b.detach().clone();
  fsdp::AdamW opt({p.w}, {.lr = 0.5, .weight_decay = 0.1}, {p.b});
  p.w.mutable_grad() = at::zeros_like(p.w);  // Adam's step is 0 for a zero gradient: only the decay acts
  opt.step();
  CHECK(test::rel_diff(p.w, w0 * (1 - 0.5 * 0.1)) < 1e-7);
  CHECK(at::equal(p.b, b0));
  opt.zero_grad();
  CHECK(p.w.grad().defined());
  CHECK(p.w.grad().abs().sum().item<double>() == 0);
}

TEST_CASE("AdamW: bad settings and parameter lists are refused, naming the setting") {
  auto p = make_params();
  auto message = [&](auto&& make) {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(message([&] { fsdp::AdamW({p.w}, {.lr = -1}); }).find("lr must be >= 0") != std::string::npos);
  CHECK(message([&] { fsdp::AdamW({p.w}, {.beta1 = 1.0}); }).find("beta1") != std::string::npos);
  CHECK(message([&] { fsdp::AdamW({p.w}, {.beta2 = -0.1}); }).find("beta2") != std::string::npos);
  CHECK(message([&] { fsdp::AdamW({p.w}, {}, {p.w}); }).find("given twice") != std::string::npos);
  fsdp::AdamW opt({p.w}, {});
  CHECK(message([&] { opt.set_lr(std::nan("")); }).find("lr must be >= 0") != std::string::npos);
}
