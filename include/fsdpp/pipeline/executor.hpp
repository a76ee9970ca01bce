#pragma once
// Executor: runs one rank's part of a lowered schedule (fsdpp/pipeline/plan.hpp) on real stages.
//
// A stage is a function from its input activation to its output (the last stage's output goes
// through the loss). Every stage boundary cuts the autograd graph: a stage's input is a fresh
// leaf, its backward sends that leaf's gradient upstream. Backward can run whole (B) or split (I
// for the input gradient, retaining the graph; W later for the weights), with the same result.
//
// Communication: each directed edge between two pipeline ranks gets its own two-rank communicator,
// created and connected in the constructor (collective over `pp`). Receive buffers are allocated
// when their RECV action runs, where the lowering posts it (PlanOptions::defer_pp_recv).
// A forward output gives up its storage once its send is issued (the send, and autograd where the
// producing op saved it, keep what they need); backward only needs its shape and autograd edge.
// Sends are asynchronous. WAIT_SEND_F / WAIT_SEND_B wait for their send where the plan puts them
// (when it is still counted), which keeps a send budget (Plan::max_outstanding_sends) where the
// plan could place it; where it could not, the budget is kept here: when that many sends are in
// flight a new one first waits for the oldest of them (sends seen complete leave the count at
// once), which the plan's simulation has shown can never deadlock. Every send is waited at the
// end of the step.
//
// OVERLAP_F_B groups (Note [overlap groups] in action.hpp): a group's computations run one after
// the other, first the one whose input is here, and after each, the sends of the computations done
// that follow the group in the plan (in the plan's order), so that one's message travels while
// another computes. On NCCL every wait is a stream dependency, so a step can be captured as a CUDA
// graph: its receive buffers then come from the graph's pool, and the budget is recorded as
// dependencies between the sends.
//
// Sharded stages (PipelineStage::sharding, pipeline/stage.hpp): a stage stays gathered from the
// plan's UNSHARD to its RESHARD, across all its microbatches (ExecutorOptions::keep_stages_unsharded,
// the default, as PyTorch's pipelining and torchtitan do: one all-gather per unit per step instead
// of two per microbatch for each nested unit; the plan's window of active stages bounds the memory).
// Gradients accumulate unsharded over the microbatches (no communication), REDUCE_GRAD issues
// the stage's reduce-scatters asynchronously and WAIT_REDUCE_GRAD waits for them; the plan places
// the wait (PlanOptions::defer_reduce_grad_wait), and the end of the step waits for any left.
//
// Loss: the loss of each microbatch is multiplied by ExecutorOptions::loss_scale (default
// 1 / microbatches), so that the accumulated gradients equal those of the mean loss over the whole
// batch (for equal microbatches, the same as an unpipelined step).
//
// Forward only (forward()): the plan's forwards, with their sends and receives, in the plan's
// order, for evaluation: activations cross ranks by the same edges and the same mechanism as in
// training, and nothing is kept for backward.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/stage.hpp"

namespace fsdpp::pipeline {

struct ExecutorOptions {
  std::vector<int64_t> activation_shape;  // every stage's input and output, per microbatch
  at::ScalarType activation_dtype = at::kFloat;
  at::Device device = at::kCPU;  // of activations, receive buffers and the loss
  // Sharded stages: keep every unit of a stage gathered between the plan's UNSHARD and RESHARD
  // (StageSharding::begin_step); false gathers nested units again for each microbatch's forward
  // and backward, which holds less memory.
  bool keep_stages_unsharded = true;
  // Multiplies each microbatch's loss in step() (0: 1 / microbatches, the mean over the step).
  double loss_scale = 0;
  // Called after each computation (F, B, I, W) with when it began, after any receive it waited
  // for, and when it ended: what a trace shows as the stage computing, and what a bubble is
  // measured against (bench/run_pipeline_real_bubble.sh).
  std::function<void(const Action&, std::chrono::system_clock::time_point begin,
                     std::chrono::system_clock::time_point end)>
      on_compute;
  // Called before each forward of a stage with the stage and the microbatch (0-based within the
  // step or forward() call): inputs every stage reads besides its activation, as PyTorch's
  // schedules hand each stage its microbatch's keyword arguments (the trainer's packed positions).
  std::function<void(int stage, int microbatch)> before_forward;
};

// What a custom function (PipelineExecutor::register_custom_function) gets for the action it runs.
struct ActionContext {
  const Action& action;
  PipelineStage& stage;  // the action's stage, on this rank
  // This step's inputs and targets, as given to step() or forward().
  const std::vector<at::Tensor>& inputs;
  const std::vector<at::Tensor>& targets;
  // Does what the executor does for the action without the custom function (a forward with its
  // received input and the loss, a backward with the received gradient ...), for a function that
  // wraps rather than replaces it.
  std::function<void()> run_default;
  // For OVERLAP_F_B (`action` is then the group's first computation): the group's computations, in
  // the plan's order, and `run`, which runs one of them as the executor does (through any custom
  // function for its type). The function must run each exactly once, in any order it likes (they
  // are independent), or call run_default; the sends that follow the group go out after it.
  std::vector<Action> group;
  std::function<void(const Action&)> run;
};
using CustomFunction = std::function<void(ActionContext&)>;

struct ExecutorStats {
  int peak_recv_buffers = 0;  // live receive buffers, at most
  int recv_buffers_allocated = 0;
  int sends = 0;
  int peak_sends_in_flight = 0;
  int outputs_released = 0;  // forward outputs whose storage was given up after their send
};

class PipelineExecutor {
 public:
  // `pp` has one rank per pipeline rank of the plan; `stages` are this rank's stages.
  PipelineExecutor(Plan plan, comm::Comm pp, std::vector<PipelineStage> stages,
                   std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> loss,
                   ExecutorOptions options);

  // One step over all microbatches: `inputs[mb]` feed the first stage, `targets[mb]` the loss
  // (only the ranks holding those stages read them). Returns the sum of the microbatch losses on
  // the rank holding the last stage, 0 elsewhere. Gradients accumulate into the parameters.
  //
  // finalize_gradients = false (PyTorch 2.15's step(finalize_gradients=False)): one of several
  // calls whose gradients add up before one optimizer step. Sharded stages then skip REDUCE_GRAD
  // and WAIT_REDUCE_GRAD and skip the RESHARD after their last backward: they stay gathered, their
  // unsharded gradients accumulating into the next call's, whose UNSHARD finds them gathered. The
  // call with true reduces everything once: one all-gather and one reduce-scatter per unit per
  // optimizer step instead of per call.
  double step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
              bool finalize_gradients = true);
  // The same, with the sum as a 0-dim float64 tensor on options.device that the host has not
  // read: nothing in the step waits for the device, so it can be captured as a CUDA graph.
  at::Tensor step_on_device(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                            bool finalize_gradients = true);

  // Forward only, for evaluation, without autograd: `inputs` hold up to the plan's
  // number of microbatches, the same count on every rank. Returns the sum of the unscaled
  // microbatch losses as a 0-dim float64 tensor on the rank holding the last stage, 0 elsewhere.
  at::Tensor forward(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);

  // Runs `function` in place of the executor's own for every action of `type` (PyTorch 2.15's
  // _PipelineScheduleRuntime.register_custom_function): FORWARD, FULL_BACKWARD, BACKWARD_INPUT,
  // BACKWARD_WEIGHT, UNSHARD, RESHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD, or OVERLAP_F_B for each
  // overlap group as a whole (see ActionContext::group); sends and receives carry the schedule's
  // messages and cannot be replaced (std::invalid_argument). A second registration for a type
  // replaces the first. The function may call ctx.run_default() to do what the executor would
  // have, before or after its own work.
  void register_custom_function(ActionType type, CustomFunction function);

  const ExecutorStats& stats() const { return stats_; }
  const Plan& plan() const { return plan_; }

 private:
  struct Slot;  // per (stage, microbatch) state during a step
  comm::Comm& edge(int from, int to);
  Slot& slot(int stage, int mb);
  at::Tensor run(const std::vector<Action>& program, const std::vector<at::Tensor>& inputs,
                 const std::vector<at::Tensor>& targets, double loss_scale, bool finalize_gradients = true);

  Plan plan_;
  comm::Comm pp_;
  std::map<int, PipelineStage> stages_;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss_;
  ExecutorOptions options_;
  std::map<std::pair<int, int>, comm::Comm> edges_;  // (from rank, to rank) -> two-rank comm
  std::map<std::pair<int, int>, std::shared_ptr<Slot>> slots_;
  std::map<ActionType, CustomFunction> custom_;
  ExecutorStats stats_;
};

}  // namespace fsdpp::pipeline
