#include "fsdpp/fsdp/adamw.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_fused_adamw.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <set>
#include <stdexcept>

namespace fsdpp::fsdp {

AdamW::AdamW(std::vector<at::Tensor> params, const AdamWOptions& options, std::vector<at::Tensor> no_decay)
    : options_(options) {
  auto bad = [](const std::string& what) { return std::invalid_argument("AdamW: " + what); };
  if (!(options.lr >= 0)) throw bad(fmt::format("lr must be >= 0, got {}", options.lr));
  if (!(options.beta1 >= 0 && options.beta1 < 1))
    throw bad(fmt::format("beta1 must be in [0, 1), got {}", options.beta1));
  if (!(options.beta2 >= 0 && options.beta2 < 1))
    throw bad(fmt::format("beta2 must be in [0, 1), got {}", options.beta2));
  if (!(options.eps >= 0)) throw bad(fmt::format("eps must be >= 0, got {}", options.eps));
  if (!(options.weight_decay >= 0))
    throw bad(fmt::format("weight_decay must be >= 0, got {}", options.weight_decay));
  std::set<const void*> seen;
  at::Device device = at::kCPU;
  at::NoGradGuard no_grad;
  for (auto* list : {&params, &no_decay})
    for (auto& p : *list) {
      if (!p.defined()) throw bad("a parameter is undefined");
      if (params_.empty()) device = p.device();
      if (p.device() != device)
        throw bad(fmt::format("parameters are on {} and {}; they must share a device", device.str(),
                              p.device().str()));
      if (!seen.insert(p.unsafeGetTensorImpl()).second) throw bad("a parameter is given twice");
      params_.push_back({p, {at::zeros_like(p), at::zeros_like(p)}, list == &params});
    }
  // ATen's fused kernel on the CPU; on a GPU the update below, whose learning rate and step count
  // stay on the device for graph capture.
  fused_ =
      options.fused && device.is_cpu() && std::all_of(params_.begin(), params_.end(), [](const Param& q) {
        return q.param.is_contiguous() && at::isFloatingType(q.param.scalar_type());
      });
  const auto f64 = at::TensorOptions(device).dtype(at::kDouble);
  lr_ = at::full({}, options.lr, f64);
  step_ = at::zeros({}, f64);
}

void AdamW::zero_grad() {
  for (auto& q : params_)
    if (q.param.grad().defined()) {
      q.param.mutable_grad().detach_();
      q.param.mutable_grad().zero_();
    }
}

void AdamW::step() {
  at::NoGradGuard no_grad;
  const auto& o = options_;
  step_.add_(1);
  if (fused_) {
    // One pass over each parameter, in ATen's fused CPU AdamW: the update of
    // torch.optim.AdamW(fused=True), bit for bit. It reads the learning rate and step count on the
    // host, which on the CPU is where they are.
    std::vector<at::Tensor> p[2], g[2], m[2], v[2], t[2];
    for (auto& q : params_) {
      const auto& grad = q.param.grad();
      if (!grad.defined()) continue;
      const int i = q.decay ? 1 : 0;
      p[i].push_back(q.param);
      // The fused kernel reads the gradient as a dense array of the parameter's dtype (a strided
      // one it would read wrongly, without a word).
      g[i].push_back(grad.to(q.param.scalar_type()).contiguous());
      m[i].push_back(q.state.exp_avg);
      v[i].push_back(q.state.exp_avg_sq);
      t[i].push_back(step_);
    }
    for (int i : {0, 1})
      if (!p[i].empty())
        at::_fused_adamw_(p[i], g[i], m[i], v[i], {}, t[i], lr_, o.beta1, o.beta2,
                          i == 1 ? o.weight_decay : 0.0, o.eps,
                          /*amsgrad=*/false, /*maximize=*/false);
    return;
  }
  const auto step_size = lr_ / (1 - at::pow(o.beta1, step_));
  const auto bc2_sqrt = (1 - at::pow(o.beta2, step_)).sqrt();
  const auto decay = 1 - lr_ * o.weight_decay;
  for (auto& q : params_) {
    const auto& g = q.param.grad();
    if (!g.defined()) continue;
    auto& p = q.param;
    if (q.decay && o.weight_decay != 0) p.mul_(decay);
    q.state.exp_avg.mul_(o.beta1).add_(g, 1 - o.beta1);
    q.state.exp_avg_sq.mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
    const auto denom = (q.state.exp_avg_sq.sqrt() / bc2_sqrt).add_(o.eps);
    p.sub_(q.state.exp_avg / denom * step_size);
  }
}

void AdamW::set_lr(double lr) {
  if (!(lr >= 0)) throw std::invalid_argument(fmt::format("AdamW: lr must be >= 0, got {}", lr));
  lr_.fill_(lr);
}

int64_t AdamW::steps() const { return static_cast<int64_t>(step_.item<double>()); }

void AdamW::set_steps(int64_t steps) {
  if (steps < 0) throw std::invalid_argument(fmt::format("AdamW: a step count must be >= 0, got {}", steps));
  step_.fill_(double(steps));
}

AdamW::State* AdamW::state(const at::Tensor& param) {
  for (auto& q : params_)
    if (q.param.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return &q.state;
  return nullptr;
}

}  // namespace fsdpp::fsdp
