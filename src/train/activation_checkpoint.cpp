#include "fsdpp/train/activation_checkpoint.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "fsdpp/base/adopt.hpp"

namespace fsdpp::train {

// Forward: the wrapped module without autograd, keeping only its input. Backward: the same forward
// again with autograd, on a fresh leaf holding the saved input, then a nested backward from the
// incoming gradient, which accumulates the parameters' gradients; the leaf's gradient goes on.
struct RecomputeInBackward : torch::autograd::Function<RecomputeInBackward> {
  // `aside` by pointer: an autograd function's tensor arguments must be defined, and it is
  // undefined for unpacked samples.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, CheckpointImpl* module,
                            const at::Tensor* aside) {
    ctx->saved_data["module"] = reinterpret_cast<int64_t>(module);
    ctx->saved_data["aside"] = aside->defined() ? c10::IValue(*aside) : c10::IValue();
    ctx->save_for_backward({x});
    at::NoGradGuard no_grad;
    return module->inner_.forward(x, *aside);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* module = reinterpret_cast<CheckpointImpl*>(ctx->saved_data["module"].toInt());
    const auto saved = ctx->get_saved_variables()[0];
    const auto& kept = ctx->saved_data["aside"];
    const at::Tensor aside = kept.isNone() ? at::Tensor() : kept.toTensor();
    auto leaf = saved.detach().requires_grad_(saved.requires_grad());
    at::Tensor out;
    {
      at::AutoGradMode grad_mode(true);
      out = module->inner_.forward(leaf, aside);
    }
    ++module->recomputes_;
    torch::autograd::backward({out}, {grads[0]});
    return {leaf.requires_grad() ? leaf.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

CheckpointImpl::CheckpointImpl(torch::nn::AnyModule inner) : inner_(std::move(inner)) {
  adopt_members(*this, *inner_.ptr());
}

at::Tensor CheckpointImpl::forward(at::Tensor x, at::Tensor aside) {
  if (!at::GradMode::is_enabled()) return inner_.forward(x, aside);  // evaluation: nothing to keep
  // The output must require a gradient for the parameters' sake even when x needs none: then the
  // recompute starts from a leaf whose gradient goes nowhere.
  return RecomputeInBackward::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), this, &aside);
}

}  // namespace fsdpp::train
