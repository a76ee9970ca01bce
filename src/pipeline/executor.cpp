#include "fsdpp/pipeline/executor.hpp"

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/base/cuda_graph.hpp"
#include "fsdpp/base/storage.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <utility>

namespace fsdpp::pipeline {

// Note [received tensors]
// A microbatch's tensors on a stage are dropped as soon as nothing reads them again: the input
// (for stages > 0, a received buffer or the previous stage's output) and the received gradient
// after the full backward, or the input after I (its graph keeps what W needs) and the rest after
// W; a computed input gradient once it is sent or taken by the previous stage on this rank. Slots
// would otherwise hold every microbatch's received tensors to the end of the step.
// tests/pipeline/executor_fixture.hpp observes this through the allocator, against the plan's
// simulated peak_received.
struct PipelineExecutor::Slot {
  at::Tensor input;        // leaf for stages > 0
  at::Tensor output;       // stage output, or the scaled loss on the last stage
  at::Tensor grad_output;  // gradient of `output` (undefined for the loss)
  at::Tensor grad_input;   // gradient of `input`, for the previous stage
  at::Tensor recv_f, recv_b;
  std::optional<comm::Work> recv_f_work, recv_b_work;
};

namespace {

// After its send is issued, a forward output's own reference to its storage is dropped: the send
// holds the bytes until they are out, autograd holds them only if the producing op saved its
// output, and backward needs no more than the tensor's shape and autograd edge.
void release_storage(at::Tensor& output) {
  auto shell = at::empty(output.sizes(), output.options());
  resize_storage_bytes(shell, 0);
  at::NoGradGuard no_grad;
  output.set_data(shell);
}

// One tag for every message: Gloo then matches sends and receives between two ranks by their
// order, as NCCL does (Note [point-to-point order]), so a schedule that runs here runs on GPUs.
// Op labels ("pp 1SEND_F0") name the messages in flight records.
constexpr uint32_t kMessageTag = 0;

}  // namespace

PipelineExecutor::PipelineExecutor(Plan plan, comm::Comm pp, std::vector<PipelineStage> stages,
                                   std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss,
                                   ExecutorOptions options)
    : plan_(std::move(plan)), pp_(std::move(pp)), loss_(std::move(loss)), options_(std::move(options)) {
  if (pp_.size() != plan_.spec.pp)
    throw ScheduleError(fmt::format("executor: the plan has {} pipeline ranks but the communicator {}",
                                    plan_.spec.pp, pp_.size()));
  for (auto& s : stages) {
    if (s.index < 0 || s.index >= plan_.spec.num_stages() || plan_.owner[s.index] != pp_.rank())
      throw ScheduleError(fmt::format(
          "executor: rank {} was given stage {}, which the plan puts on rank {}", pp_.rank(), s.index,
          s.index >= 0 && s.index < plan_.spec.num_stages() ? plan_.owner[s.index] : -1));
    stages_[s.index] = std::move(s);
  }
  for (int s = 0; s < plan_.spec.num_stages(); ++s)
    if (plan_.owner[s] == pp_.rank() && !stages_.count(s))
      throw ScheduleError(
          fmt::format("executor: rank {} holds stage {} in the plan but was not given it", pp_.rank(), s));
  // One communicator per directed edge, in the same order on every rank (each split is
  // collective over pp).
  std::set<std::pair<int, int>> edges;
  for (int s = 0; s + 1 < plan_.spec.num_stages(); ++s) {
    const int a = plan_.owner[s], b = plan_.owner[s + 1];
    if (a != b) edges.insert({a, b}), edges.insert({b, a});
  }
  for (const auto& [from, to] : edges) {
    const bool member = pp_.rank() == from || pp_.rank() == to;
    auto c = pp_.split(member ? 0 : -1, pp_.rank() == from ? 0 : 1);
    if (member) edges_[{from, to}] = std::move(c);
  }
}

comm::Comm& PipelineExecutor::edge(int from, int to) { return edges_.at({from, to}); }

PipelineExecutor::Slot& PipelineExecutor::slot(int stage, int mb) {
  auto& p = slots_[{stage, mb}];
  if (!p) p = std::make_shared<Slot>();
  return *p;
}

double PipelineExecutor::step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                              bool finalize_gradients) {
  return step_on_device(inputs, targets, finalize_gradients).item<double>();
}

at::Tensor PipelineExecutor::step_on_device(const std::vector<at::Tensor>& inputs,
                                            const std::vector<at::Tensor>& targets, bool finalize_gradients) {
  const int m = plan_.spec.microbatches;
  if (static_cast<int>(inputs.size()) != m || static_cast<int>(targets.size()) != m)
    throw ScheduleError(
        fmt::format("executor: a step takes the plan's {} microbatches, got {} inputs and {} targets", m,
                    inputs.size(), targets.size()));
  return run(plan_.lowered[pp_.rank()], inputs, targets,
             options_.loss_scale > 0 ? options_.loss_scale : 1.0 / m, finalize_gradients);
}

at::Tensor PipelineExecutor::forward(const std::vector<at::Tensor>& inputs,
                                     const std::vector<at::Tensor>& targets) {
  const int count = static_cast<int>(inputs.size());
  if (count < 1 || count > plan_.spec.microbatches || targets.size() != inputs.size())
    throw ScheduleError(
        fmt::format("executor: forward takes 1 to {} microbatches, got {} inputs and {} targets",
                    plan_.spec.microbatches, inputs.size(), targets.size()));
  // The plan's forwards of the first `count` microbatches, with their messages, in the plan's order:
  // a subset closed under dependencies, taken alike on every rank, so it runs as the plan does.
  using T = ActionType;
  std::vector<Action> program;
  for (const Action& a : plan_.lowered[pp_.rank()]) {
    const bool forward_part = a.type == T::kForward || a.type == T::kSendF || a.type == T::kRecvF;
    if ((forward_part && a.microbatch < count) || a.type == T::kUnshard || a.type == T::kReshard) {
      program.push_back(a);
      program.back().with_previous = false;  // a group's other computations are not here
    }
  }
  at::NoGradGuard no_grad;
  return run(program, inputs, targets, 1.0);
}

void PipelineExecutor::register_custom_function(ActionType type, CustomFunction function) {
  using T = ActionType;
  static const std::set<T> replaceable{T::kForward,        T::kBackward,       T::kBackwardInput,
                                       T::kBackwardWeight, T::kUnshard,        T::kReshard,
                                       T::kReduceGrad,     T::kWaitReduceGrad, T::kOverlapFB};
  if (!replaceable.count(type))
    throw std::invalid_argument(fmt::format(
        "executor: register_custom_function: {} carries the schedule's messages and cannot be replaced; "
        "custom functions run F, B, I, W, UNSHARD, RESHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD or OVERLAP_F_B",
        type_token(type)));
  if (!function) throw std::invalid_argument("executor: register_custom_function: an empty function");
  custom_[type] = std::move(function);
}

at::Tensor PipelineExecutor::run(const std::vector<Action>& program, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& targets, double loss_scale,
                                 bool finalize_gradients) {
  const int me = pp_.rank(), last = plan_.spec.num_stages() - 1;
  const auto act_options = at::TensorOptions(options_.device).dtype(options_.activation_dtype);
  // Sends in flight, oldest first. Under the budget a send first waits for the oldest, as the
  // plan's simulation assumes. On NCCL that wait is a stream dependency, not a host wait: while
  // the step is being captured as a CUDA graph the host cannot know what has completed (every
  // operation reads as done), so nothing is dropped from the front unwaited, and the budget is
  // recorded in the graph as dependencies between the sends. WAIT_SEND_F / WAIT_SEND_B wait for
  // their own send, if it is still counted.
  std::deque<std::pair<Action, comm::Work>> sends;
  const bool captured = options_.device.is_cuda() && fsdpp::stream_capturing(options_.device.index());
  auto send = [&](const Action& a, int to, const at::Tensor& t) {
    const int budget = plan_.max_outstanding_sends;
    if (!captured)
      while (!sends.empty() && sends.front().second.is_completed()) sends.pop_front();
    while (budget > 0 && static_cast<int>(sends.size()) >= budget) {
      sends.front().second.wait();
      sends.pop_front();
    }
    sends.emplace_back(a, edge(me, to).send(t, 1, kMessageTag));
    ++stats_.sends;
    stats_.peak_sends_in_flight = std::max(stats_.peak_sends_in_flight, static_cast<int>(sends.size()));
  };
  auto loss_sum = at::zeros({}, at::TensorOptions(options_.device).dtype(at::kDouble));
  auto computed = [&](const Action& a, std::chrono::system_clock::time_point begin) {
    if (options_.on_compute) options_.on_compute(a, begin, std::chrono::system_clock::now());
  };
  slots_.clear();
  int live_buffers = 0;
  auto new_buffer = [&] {
    ++stats_.recv_buffers_allocated;
    stats_.peak_recv_buffers = std::max(stats_.peak_recv_buffers, ++live_buffers);
    return at::empty(options_.activation_shape, act_options);
  };
  using T = ActionType;
  std::vector<StageSharding*> reducing;  // stages whose reduce-scatters are in flight
  auto finish_reduces = [&] {
    for (auto* sharding : reducing) sharding->wait_reduce_grads();
    reducing.clear();
  };
  for (auto& [index, st] : stages_)
    if (st.sharding) st.sharding->begin_step(options_.keep_stages_unsharded);
  std::map<int, int> backwards;  // per stage: full backwards and weight halves run so far
  auto run_action = [&](const Action& a) {
    const int s = a.stage, mb = a.microbatch;
    switch (a.type) {
      case T::kRecvF: {
        auto& sl = slot(s, mb);
        sl.recv_f = new_buffer();
        sl.recv_f_work = edge(plan_.owner[s - 1], me).recv(sl.recv_f, 0, kMessageTag);
        break;
      }
      case T::kRecvB: {
        auto& sl = slot(s, mb);
        sl.recv_b = new_buffer();
        sl.recv_b_work = edge(plan_.owner[s + 1], me).recv(sl.recv_b, 0, kMessageTag);
        break;
      }
      case T::kForward: {
        auto& sl = slot(s, mb);
        at::Tensor x;
        if (s == 0) {
          x = inputs.at(mb);
        } else if (sl.recv_f.defined()) {
          sl.recv_f_work->wait();
          sl.recv_f_work.reset();  // a finished receive's Work may still hold its buffer
          x = sl.recv_f;
          sl.recv_f = at::Tensor();
          --live_buffers;
        } else {
          x = slot(s - 1, mb).output.detach();  // the previous stage runs on this rank
        }
        const auto begin = std::chrono::system_clock::now();
        sl.input = s == 0 ? x : x.detach().requires_grad_(true);
        if (options_.before_forward) options_.before_forward(s, mb);
        at::Tensor out = stages_.at(s).forward(sl.input);
        if (s == last) {
          out = loss_(out, targets.at(mb)) * loss_scale;
          loss_sum.add_(out.detach().to(at::kDouble));
        }
        sl.output = out;
        if (!at::GradMode::is_enabled()) sl.input = at::Tensor();  // forward only: read once
        computed(a, begin);
        break;
      }
      case T::kSendF:
        send(a, plan_.owner[s + 1], slot(s, mb).output.detach().contiguous());
        release_storage(slot(s, mb).output);
        ++stats_.outputs_released;
        break;
      case T::kBackward:
      case T::kBackwardInput: {
        auto& sl = slot(s, mb);
        if (s < last) {
          if (sl.recv_b.defined()) {
            sl.recv_b_work->wait();
            sl.recv_b_work.reset();
            sl.grad_output = sl.recv_b;
            sl.recv_b = at::Tensor();
            --live_buffers;
          } else {
            // the next stage runs on this rank
            sl.grad_output = std::exchange(slot(s + 1, mb).grad_input, at::Tensor());
          }
        }
        const auto begin = std::chrono::system_clock::now();
        const std::vector<at::Tensor> outs{sl.output};
        const std::vector<at::Tensor> grads{sl.grad_output};
        if (a.type == T::kBackward) {
          std::vector<at::Tensor> wrt = stages_.at(s).parameters;
          if (s > 0) wrt.push_back(sl.input);
          torch::autograd::backward(outs, grads, /*retain_graph=*/false, /*create_graph=*/false, wrt);
          if (s > 0) sl.grad_input = sl.input.grad();
          // Note [received tensors]: nothing of this microbatch is read again on this stage.
          sl.input = sl.output = sl.grad_output = at::Tensor();
        } else {
          if (s > 0) sl.grad_input = torch::autograd::grad(outs, {sl.input}, grads, /*retain_graph=*/true)[0];
          sl.input = at::Tensor();  // what W needs of it, its graph has saved
        }
        computed(a, begin);
        break;
      }
      case T::kBackwardWeight: {
        auto& sl = slot(s, mb);
        const auto begin = std::chrono::system_clock::now();
        torch::autograd::backward({sl.output}, {sl.grad_output}, /*retain_graph=*/false,
                                  /*create_graph=*/false, stages_.at(s).parameters);
        sl.output = sl.grad_output = at::Tensor();
        computed(a, begin);
        break;
      }
      case T::kSendB:
        send(a, plan_.owner[s - 1], slot(s, mb).grad_input.contiguous());
        slot(s, mb).grad_input = at::Tensor();  // the send holds it until it is out
        break;
      case T::kUnshard:
        if (auto& sharding = stages_.at(s).sharding)
          sharding->unshard_async();  // waited where forward needs it
        break;
      case T::kReshard:
        // Not finalizing, a stage whose every microbatch went backward stays gathered for the next
        // call (see step()).
        if (auto& sharding = stages_.at(s).sharding;
            sharding && (finalize_gradients || backwards[s] < plan_.spec.microbatches))
          sharding->reshard();
        break;
      case T::kReduceGrad:
        if (auto& sharding = stages_.at(s).sharding; sharding && finalize_gradients) {
          sharding->reduce_grads_async();
          reducing.push_back(sharding.get());
        }
        break;
      case T::kWaitSendF:
      case T::kWaitSendB: {
        const Action sent = *waited_send(a);
        const auto it =
            std::find_if(sends.begin(), sends.end(), [&](const auto& p) { return p.first == sent; });
        if (it != sends.end()) {
          it->second.wait();
          sends.erase(it);
        }
        break;
      }
      case T::kWaitReduceGrad:
        if (auto& sharding = stages_.at(s).sharding)
          if (const auto it = std::find(reducing.begin(), reducing.end(), sharding.get());
              it != reducing.end()) {
            sharding->wait_reduce_grads();
            reducing.erase(it);
          }
        break;
      case T::kOverlapFB:  // names a group for custom functions; a program holds its actions
        break;
    }
  };
  auto perform = [&](const Action& a) {
    comm::OpLabel op_label("pp " + to_string(a));
    if (a.type == T::kBackward || a.type == T::kBackwardWeight) ++backwards[a.stage];
    if (const auto it = custom_.find(a.type); it != custom_.end()) {
      ActionContext ctx{a, stages_.at(a.stage), inputs, targets, [&] { run_action(a); }, {}, {}};
      it->second(ctx);
    } else {
      run_action(a);
    }
  };
  // Whether a computation's input is here: produced on this rank, or its receive completed. While
  // a step is captured as a CUDA graph every receive reads as completed.
  auto input_here = [&](const Action& a) {
    auto& sl = slot(a.stage, a.microbatch);
    if (a.type == T::kForward) return !sl.recv_f.defined() || sl.recv_f_work->is_completed();
    if (a.type == T::kBackward || a.type == T::kBackwardInput)
      return !sl.recv_b.defined() || sl.recv_b_work->is_completed();
    return true;
  };
  // An overlap group (Note [overlap groups]) from program[first] to program[end]: its computations
  // one after the other, each as soon as it can start (the first in the plan whose input is here,
  // so that one computes while another's input is still arriving), and after each, what follows
  // the group as far as it is ready, in the plan's order: the sends of the computations done (in
  // flight while the others compute) and waits for earlier sends. On CPU, with no input here yet,
  // this thread watches for the first to arrive; on CUDA the host does not wait for the device,
  // and the computations are queued in the plan's order. Returns where the program goes on.
  auto run_group = [&](size_t first, size_t end) {
    std::vector<Action> todo(program.begin() + static_cast<std::ptrdiff_t>(first),
                             program.begin() + static_cast<std::ptrdiff_t>(end));
    std::vector<Action> done;
    auto computed_here = [&](const Action& send) {
      return std::any_of(done.begin(), done.end(), [&](const Action& c) {
        return c.stage == send.stage && c.microbatch == send.microbatch &&
               (send.type == T::kSendF ? c.type == T::kForward
                                       : c.type == T::kBackward || c.type == T::kBackwardInput);
      });
    };
    size_t i = end;
    while (!todo.empty()) {
      auto next = std::find_if(todo.begin(), todo.end(), input_here);
      while (next == todo.end() && options_.device.is_cpu()) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        next = std::find_if(todo.begin(), todo.end(), input_here);
      }
      if (next == todo.end()) next = todo.begin();
      perform(*next);
      done.push_back(*next);
      todo.erase(next);
      for (; i < program.size(); ++i) {
        const Action& a = program[i];
        const bool ready =
            is_send_wait(a.type) || ((a.type == T::kSendF || a.type == T::kSendB) && computed_here(a));
        if (!ready) break;
        perform(a);
      }
    }
    return i;
  };
  for (size_t i = 0; i < program.size();) {
    const size_t end = group_end(program, i);
    if (end == i + 1) {
      perform(program[i++]);
      continue;
    }
    const auto custom = custom_.find(T::kOverlapFB);
    if (custom == custom_.end()) {
      i = run_group(i, end);
      continue;
    }
    // A custom function takes the group: it runs each computation once (or the executor's way).
    std::vector<Action> group(program.begin() + static_cast<std::ptrdiff_t>(i),
                              program.begin() + static_cast<std::ptrdiff_t>(end)),
        ran;
    size_t next = end;
    ActionContext ctx{program[i],
                      stages_.at(program[i].stage),
                      inputs,
                      targets,
                      [&] {
                        if (!ran.empty())
                          throw ScheduleError("executor: OVERLAP_F_B's run_default after the group's run");
                        next = run_group(i, end);
                        ran = group;
                      },
                      {},
                      {}};
    ctx.group = group;
    ctx.run = [&](const Action& a) {
      if (std::find(group.begin(), group.end(), a) == group.end() ||
          std::find(ran.begin(), ran.end(), a) != ran.end())
        throw ScheduleError("executor: the custom function for OVERLAP_F_B ran " + to_string(a) +
                            ", which is not one of its group's computations left to run");
      perform(a);
      ran.push_back(a);
    };
    comm::OpLabel op_label("pp OVERLAP_F_B");
    custom->second(ctx);
    for (const auto& a : group)
      if (std::find(ran.begin(), ran.end(), a) == ran.end())
        throw ScheduleError("executor: the custom function for OVERLAP_F_B returned without running " +
                            to_string(a) + " of its group");
    i = next;
  }
  finish_reduces();
  std::vector<comm::Work> left;
  for (auto& [action, work] : sends) left.push_back(std::move(work));
  comm::wait_all(left);
  slots_.clear();
  return loss_sum;
}

}  // namespace fsdpp::pipeline
