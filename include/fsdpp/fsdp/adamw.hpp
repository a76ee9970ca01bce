#pragma once
// AdamW for sharded parameters whose learning rate and step count live in tensors on the
// parameters' device, so that step() reads nothing on the host: a whole training step, optimizer
// included, can be captured once as a CUDA graph and replayed, with set_lr() changing the rate
// between replays. The update is torch.optim.AdamW's (decoupled weight decay, bias correction),
// with one step count for all parameters:
//   p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// State (m, v) is allocated with the optimizer, so its addresses never change. A parameter
// without a gradient is left alone in a step. On the CPU (with options.fused, the default, and
// dense floating-point parameters) the update is ATen's fused AdamW kernel, one pass per
// parameter, bitwise torch.optim.AdamW(fused=True) (m by lerp, the step size and bias corrections
// in float64 on the host); on a GPU it is the tensor expression above, with the learning rate and
// step count read on the device.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdpp::fsdp {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  // On the CPU, ATen's fused kernel; false: the tensor expression a GPU runs, there too.
  bool fused = true;
};

class AdamW {
 public:
  // `params` decay with options.weight_decay, `no_decay` (norm weights, biases) without. Every
  // parameter must be on the same device; each appears once.
  AdamW(std::vector<at::Tensor> params, const AdamWOptions& options, std::vector<at::Tensor> no_decay = {});

  // Zeroes gradients in place (their storage is kept, so addresses stay fixed across steps).
  void zero_grad();
  // One update of every parameter that has a gradient; no host synchronisation.
  void step();

  // Writes the learning rate of the next step() into the device tensor.
  void set_lr(double lr);
  const at::Tensor& lr() const { return lr_; }
  // Steps taken (reads the device tensor: not for use inside a captured region).
  int64_t steps() const;
  void set_steps(int64_t steps);

  struct State {
    at::Tensor exp_avg, exp_avg_sq;
  };
  // The state of `param` (one of the optimizer's), or null for a tensor it does not update.
  State* state(const at::Tensor& param);
  const AdamWOptions& options() const { return options_; }

 private:
  struct Param {
    at::Tensor param;
    State state;
    bool decay;
  };
  AdamWOptions options_;
  std::vector<Param> params_;
  at::Tensor lr_, step_;  // 0-dim float64 on the parameters' device
  bool fused_ = false;    // CPU parameters, each dense and floating point
};

}  // namespace fsdpp::fsdp
