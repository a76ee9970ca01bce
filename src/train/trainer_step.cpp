// One training step (Note [capturable step]) and evaluation.
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdlib>

#include "fsdpp/base/device_check.hpp"
#include "trainer_impl.hpp"

namespace fsdpp::train::detail {

namespace {

// Linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step.
double learning_rate(const OptimOptions& o, int64_t step, int64_t total) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  const double progress =
      std::min(1.0, double(step - o.warmup_steps) / double(std::max<int64_t>(1, total - o.warmup_steps)));
  return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
}

}  // namespace

// Note [capturable step]
// A step is split in two. fill_inputs() runs on the host: the learning rate and this step's
// tokens go into tensors that exist for the whole run (the static inputs). step_body() then does
// everything else (every microbatch's forward and backward with fully_shard's collectives or the
// pipeline schedule, clipping, the optimizer) and reads no device value on the host: losses,
// router statistics and the clipping norm stay in device tensors, gathered into one all-reduce,
// and are read after the step. So on a GPU the body can be captured once as a CUDA graph and
// replayed (train.cuda_graph). On any device it issues the same collectives in the same order
// every step (train.run checks that from traces; tests/train/test_capture.cpp checks fully_shard's
// and the optimizer's fixed addresses).

// Every unit is gathered once, before the threads start, and stays gathered until all are done: no
// collective runs while they compute. Thread 0 runs the sharded model (its hooks keep the
// gradients unreduced: gradient sync is off), thread t > 0 the copy thread_models_[t - 1]; thread
// t runs microbatches t, t + n, ... Then the copies' gradients join the sharded model's, every
// unit's gradients are reduce-scattered, and the units are resharded for the optimizer step.
void Trainer::microbatches_on_threads(at::Tensor& loss_sum) {
  auto& root = roots_.front();
  const int n = recipe_.cpu.microbatch_threads;
  const int64_t accum = recipe_.train.grad_accum;
  if (!team_) team_ = std::make_unique<ThreadTeam>(n);
  for (auto& copy : thread_models_) {
    copy->router_stats().reset();
    copy->router_stats().aux_grad_scale = 1.0 / double(accum);
  }
  root->inner().router_stats().aux_grad_scale = 1.0 / double(accum);
  root->set_requires_gradient_sync(false);
  root->set_reshard_after_forward(false);
  root->set_reshard_after_backward(false);
  root->unshard();

  const auto b0 = std::chrono::system_clock::now();
  std::vector<at::Tensor> sums(n);
  std::vector<std::chrono::system_clock::time_point> ends(n);  // each thread's, for the trace
  const int intra_op = at::get_num_threads();
  team_->run([&](int t) {
    at::set_num_threads(1);  // OpenMP's (and MKL's) thread count is the calling thread's own
    auto sum = at::zeros({}, loss_sum.options());
    for (int64_t j = t; j < accum; j += n) {
      if (!positions_.empty()) (t == 0 ? root->inner() : *thread_models_[t - 1]).set_positions(positions_[j]);
      const auto logits = t == 0 ? root->forward(inputs_[j]) : thread_models_[t - 1]->forward(inputs_[j]);
      if (counted_targets()) {  // Note [counted targets]
        const auto loss = models::summed_lm_loss(logits, targets_[j]);
        (loss * token_scale_).backward();
        sum.add_(loss.detach().to(at::kDouble));
        continue;
      }
      const auto loss = models::lm_loss(logits, targets_[j]);
      (loss / double(accum)).backward();
      sum.add_(loss.detach().to(at::kDouble));
    }
    sums[t] = sum;
    ends[t] = std::chrono::system_clock::now();
  });
  at::set_num_threads(intra_op);
  span(fmt::format("forward and backward, {} threads", n), "compute", b0);
  if (tracer_.active())  // one track per thread: a thread that finishes early shows as a gap on its track
    for (int t = 0; t < n; ++t)
      tracer_.span(fmt::format("forward and backward, thread {}", t), fmt::format("microbatch thread {}", t),
                   b0, ends[t]);

  at::NoGradGuard g;
  for (const auto& sum : sums) loss_sum.add_(sum);
  for (const auto& [copy, param] : thread_params_) {
    auto& grad = copy.mutable_grad();
    if (!grad.defined()) continue;  // a parameter this thread's microbatches did not reach
    auto& to = param.mutable_grad();
    if (to.defined())  // in .grad's dtype, as AccumulateGrad adds (Note [unsharded gradients])
      to.add_(grad.element_size() > to.element_size() ? grad.to(to.scalar_type()) : grad);
    else
      to = std::move(grad);
    grad = at::Tensor();
  }
  root->fsdp_unit().reduce_grads_async();
  root->fsdp_unit().wait_reduce_grads();
  root->reshard();
  root->set_reshard_after_forward(std::nullopt);
  root->set_reshard_after_backward(true);
  root->set_requires_gradient_sync(true);
}

// Note [counted targets]
// With conversations only the assistant's targets count, and microbatches, ranks and steps hold
// different numbers of them. The loss is the mean over the counted targets of the whole global
// batch, as transformers' Trainer computes it with num_items_in_batch: each microbatch's loss is
// its sum times dp / (the global batch's count), since the reduce-scatter averages over the dp
// ranks. The count is known before the step (every rank computes the whole batch's order), so it
// enters as a device tensor that a captured step reads at replay; the reported loss is the world's
// summed losses over the world's counted targets.
void Trainer::fill_inputs(int64_t step) {
  current_lr_ = learning_rate(recipe_.optim, step, recipe_.train.steps);
  optimizer_->set_lr(current_lr_);
  const int64_t B = recipe_.train.global_batch, mb = recipe_.micro_batch(), T = recipe_.data.seq_len;
  const int64_t base = step * B + dp_rank() * (B / recipe_.parallel.dp);
  const int64_t count = int64_t(inputs_.size());
  if (counted_targets()) {
    const double global = double(std::max<int64_t>(1, chat_train_->counted(step * B, B)));
    const double per_step =
        double(recipe_.train.grad_accum * (executor_ ? recipe_.parallel.microbatches : 1));
    token_scale_.fill_(double(recipe_.parallel.dp) / global);
    pp_token_scale_.fill_(double(recipe_.parallel.dp) * per_step / global);
    local_targets_.fill_(holds_last_stage() ? double(chat_train_->counted(base, count * mb)) : 0.0);
    for (int64_t i = 0; i < count; ++i) {
      const auto b = chat_train_->samples(base + i * mb, mb);
      inputs_[i].copy_(b.inputs);
      targets_[i].copy_(b.targets);
      if (!positions_.empty()) positions_[i].copy_(b.positions);
    }
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    const auto batch = train_data_->samples(base + i * mb, mb);
    inputs_[i].copy_(batch.narrow(1, 0, T));
    targets_[i].copy_(batch.narrow(1, 1, T));
  }
}

at::Tensor Trainer::step_body() {
  const int64_t accum = recipe_.train.grad_accum;
  for (auto& root : roots_) root->inner().router_stats().reset();
  optimizer_->zero_grad();
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device_);
  auto loss_sum = at::zeros({}, f64);
  double losses = 0;  // how many losses loss_sum holds; the same every step
  if (!executor_ && !thread_models_.empty()) {
    microbatches_on_threads(loss_sum);
    losses += double(accum);
  } else if (!executor_) {
    auto& root = roots_.front();
    root->inner().router_stats().aux_grad_scale = 1.0 / double(accum);
    for (int64_t j = 0; j < accum; ++j) {
      root->set_requires_gradient_sync(j + 1 == accum);
      // Blocks kept gathered through forward stay so through the no-sync microbatches too.
      if (!recipe_.parallel.reshard_after_forward) root->set_reshard_after_backward(j + 1 == accum);
      auto b0 = std::chrono::system_clock::now();
      if (!positions_.empty()) root->inner().set_positions(positions_[j]);
      const auto logits = root->forward(inputs_[j]);
      const auto loss = counted_targets()
                            ? models::summed_lm_loss(logits, targets_[j])  // Note [counted targets]
                            : models::lm_loss(logits, targets_[j]);
      span("forward", "compute", b0);
      b0 = std::chrono::system_clock::now();
      if (counted_targets())
        (loss * token_scale_).backward();
      else
        (loss / double(accum)).backward();
      span("backward", "compute", b0);
      loss_sum.add_(loss.detach().to(at::kDouble));
      losses += 1;
    }
  } else {
    const int m = recipe_.parallel.microbatches;
    for (auto& root : roots_) root->inner().router_stats().aux_grad_scale = 1.0 / double(accum * m);
    for (int64_t a = 0; a < accum; ++a) {
      const std::vector<at::Tensor> xs(inputs_.begin() + a * m, inputs_.begin() + (a + 1) * m);
      const std::vector<at::Tensor> ys(targets_.begin() + a * m, targets_.begin() + (a + 1) * m);
      if (!positions_.empty())
        stage_positions_.assign(positions_.begin() + a * m, positions_.begin() + (a + 1) * m);
      const auto b0 = std::chrono::system_clock::now();
      // Sharded stages stay gathered across the accumulation's calls, reducing once at the last.
      const auto mean_scaled = executor_->step_on_device(xs, ys, /*finalize_gradients=*/a + 1 == accum);
      // (the sum over microbatches of loss / (accum m))
      span("pipeline step", "compute", b0);
      if (holds_last_stage() && counted_targets())
        loss_sum.add_(mean_scaled / token_scale_);  // the summed losses (Note [counted targets])
      else if (holds_last_stage())
        loss_sum.add_(mean_scaled * double(accum * m)), losses += m;
    }
  }

  // Clip by the norm over every shard of every rank; the squared norm travels in the same
  // all-reduce as the figures the step reports.
  auto c0 = std::chrono::system_clock::now();
  std::vector<at::Tensor> grads;
  if (first_replica())
    for (auto& p : params_)
      if (p.grad().defined()) grads.push_back(p.grad());
  auto sq = fsdp::squared_sum(grads, device_);
  auto router = at::zeros({5}, f64);  // aux loss, z-loss, dropped, assignments, forwards
  {
    at::NoGradGuard g;
    for (auto& root : roots_)
      if (const auto& st = root->inner().router_stats(); st.sums.defined()) router.add_(st.sums);
    for (auto& copy : thread_models_)
      if (const auto& st = copy->router_stats(); st.sums.defined()) router.add_(st.sums);
  }
  // at::full: a fill on the device, which a capture accepts (a copy from host memory it refuses).
  auto sums = at::cat(
      {at::stack({sq, loss_sum}), counted_targets() ? local_targets_ : at::full({1}, losses, f64), router});
  world().all_reduce(sums).wait();
  if (recipe_.optim.grad_clip > 0) {
    // min(1, clip / norm): multiplying by exactly 1 leaves gradients under the limit unchanged.
    const auto scale = at::clamp_max(recipe_.optim.grad_clip / (sums[0].sqrt() + 1e-6), 1.0);
    at::NoGradGuard g;
    for (auto& p : params_)
      if (p.grad().defined()) p.grad().mul_(scale);
  }
  span("clip", "compute", c0);
  c0 = std::chrono::system_clock::now();
  optimizer_->step();
  span("optimizer", "compute", c0);
  return sums;
}

double Trainer::train_step(int64_t step) {
  fill_inputs(step);
  at::Tensor sums;
  if (!checked_devices_ && std::getenv("FSDPP_CHECK_DEVICES") &&
      std::string(std::getenv("FSDPP_CHECK_DEVICES")) == "1") {
    // Every tensor the step makes must be made on the step's device (include/fsdpp/base/device_check.hpp).
    checked_devices_ = true;
    std::vector<std::string> found;
    {
      fsdpp::DefaultDeviceCheck check;
      const auto body = [&] { sums = step_body(); };
      if (recipe_.train.cuda_graph)
        fsdpp::CapturedStep::warm_up(body);  // it is one of the eager warm-up steps (below)
      else
        body();
      found = check.findings();
    }
    if (!found.empty())
      throw std::runtime_error(
          fmt::format("FSDPP_CHECK_DEVICES: the training step makes tensors on the default "
                      "device (the CPU, whatever train.device is):\n  {}",
                      fmt::join(found, "\n  ")));
    log("FSDPP_CHECK_DEVICES: the step makes every tensor on its device");
    if (recipe_.train.cuda_graph) ++warmup_steps_done_;  // it was one of the eager warm-up steps
  } else if (!recipe_.train.cuda_graph) {
    sums = step_body();
  } else if (!graph_) {
    // Eager warm-up steps first: they create gradients, optimizer state and the communicators'
    // buffers, which the captured step then uses in place.
    if (++warmup_steps_done_ <= kGraphWarmupSteps) {
      fsdpp::CapturedStep::warm_up([&] { sums = step_body(); });
    } else {
      const auto c0 = std::chrono::system_clock::now();
      graph_ = fsdpp::CapturedStep::capture([this] { graph_sums_ = step_body(); });
      span("capture", "compute", c0);
      log(fmt::format("captured one step as a CUDA graph after {} eager steps", kGraphWarmupSteps));
    }
  }
  if (graph_) {
    const auto c0 = std::chrono::system_clock::now();
    graph_->replay();
    span("step (graph replay)", "compute", c0);
    sums = graph_sums_;
  }

  // The step is done: read its figures.
  const auto h = sums.to(at::kCPU);
  const double* v = h.data_ptr<double>();  // sq, loss sum, losses, aux, z, dropped, assignments, forwards
  last_grad_norm_ = std::sqrt(v[0]);
  last_stats_ = {v[3] / std::max(1.0, v[7]), v[4] / std::max(1.0, v[7]), v[6] > 0 ? v[5] / v[6] : 0.0,
                 current_lr_};
  return v[1] / std::max(1.0, v[2]);
}

double Trainer::evaluate() {
  at::NoGradGuard no_grad;
  // Start and end resharded, as every training step does: forward then gathers the parameters as
  // the last step left them (a replayed CUDA graph updates them without the units' host-side state
  // knowing), and the next step finds the units as it expects.
  for (auto& root : roots_) root->reshard();
  const int64_t mb = recipe_.micro_batch(), T = recipe_.data.seq_len;
  const int dp = recipe_.parallel.dp;
  double loss_sum = 0, count = 0;
  // Pipelined: up to one step's microbatches at a time through the executor's forward-only mode
  // (activations cross ranks as in training); the rank holding the last stage holds the losses.
  const int64_t group = executor_ ? recipe_.parallel.microbatches : 1;
  for (int64_t first = 0; first < recipe_.eval.batches; first += group) {
    std::vector<at::Tensor> xs, ys;
    stage_positions_.clear();
    for (int64_t b = first; b < std::min(first + group, recipe_.eval.batches); ++b) {
      // The validation set in order; every rank its own slice of each batch.
      if (counted_targets()) {
        const auto v = chat_val_->samples((b * dp + dp_rank()) * mb, mb);
        xs.push_back(v.inputs.to(device_));
        ys.push_back(v.targets.to(device_));
        if (v.positions.defined()) stage_positions_.push_back(v.positions.to(device_));
        continue;
      }
      const auto batch = val_data_->samples((b * dp + dp_rank()) * mb, mb).to(device_);
      xs.push_back(batch.narrow(1, 0, T));
      ys.push_back(batch.narrow(1, 1, T));
    }
    // Counted targets: summed losses over the counted targets' number (Note [counted targets]).
    const auto targets = [&] {
      double n = 0;
      for (const auto& y : ys) n += double((y != -100).sum().item<int64_t>());
      return n;
    };
    if (!executor_) {
      if (!stage_positions_.empty()) roots_.front()->inner().set_positions(stage_positions_[0]);
      if (counted_targets()) {
        loss_sum += models::summed_lm_loss(roots_.front()->forward(xs[0]), ys[0]).item<double>();
        count += targets();
      } else {
        loss_sum += models::lm_loss(roots_.front()->forward(xs[0]), ys[0]).item<double>();
        count += 1;
      }
      continue;
    }
    loss_sum += executor_->forward(xs, ys).item<double>();
    if (holds_last_stage()) count += counted_targets() ? targets() : double(xs.size());
  }
  for (auto& root : roots_) root->reshard();
  const auto sums = sum_over_world({loss_sum, count});
  return sums[0] / std::max(1.0, sums[1]);
}

}  // namespace fsdpp::train::detail
