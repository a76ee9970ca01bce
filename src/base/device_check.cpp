#include "fsdpp/base/device_check.hpp"

#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>
#include <fmt/format.h>

#include <map>
#include <mutex>

namespace fsdpp {

struct DefaultDeviceCheck::State {
  std::vector<std::string> order;
  std::map<std::string, int> count;
};

namespace {

// The check active on this thread, and this thread's place inside operators and backward nodes.
thread_local DefaultDeviceCheck* active = nullptr;
thread_local DefaultDeviceCheck::State* active_state = nullptr;
thread_local int depth = 0;  // operators entered; a factory at depth 0 is called by the code itself
struct BackwardNode {
  std::string name;
  int depth;  // outside it: a backward pass runs inside an operator (aten::_backward), its nodes' code does not
};
thread_local std::vector<BackwardNode> backward_nodes;

// One global callback, present while any thread has a check.
std::mutex registration_mutex;
int checks = 0;
at::CallbackHandle handle = 0;

struct Entered : at::ObserverContext {
  bool backward_node = false;
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!active_state) return nullptr;
  auto entered = std::make_unique<Entered>();
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    entered->backward_node = true;
    backward_nodes.push_back({fn.name(), depth});
    depth = 0;
    return entered;
  }
  if (depth++ == 0) {
    if (const auto schema = fn.operator_schema()) {
      // A factory: it has a device argument and no tensor to take the device from (x.new_zeros and
      // at::zeros_like follow their tensor's).
      const auto& args = schema->arguments();
      const auto inputs = fn.inputs();
      bool unset = false, from_tensor = false;
      for (size_t i = 0; i < args.size() && i < inputs.size(); ++i) {
        if (args[i].name() == "device" && inputs[i].isNone()) unset = true;
        if (inputs[i].isTensor()) from_tensor = true;
      }
      if (unset && !from_tensor) {
        const std::string what =
            fmt::format("{} without a device, {}", fn.name(),
                        backward_nodes.empty() ? std::string("in forward")
                                               : "in the backward of " + backward_nodes.back().name);
        if (active_state->count[what]++ == 0) active_state->order.push_back(what);
      }
    }
  }
  return entered;
}

void on_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  auto* entered = static_cast<Entered*>(ctx);
  if (!entered) return;
  if (entered->backward_node) {
    if (!backward_nodes.empty()) {
      depth = backward_nodes.back().depth;
      backward_nodes.pop_back();
    }
  } else if (depth > 0) {
    --depth;
  }
}

}  // namespace

DefaultDeviceCheck::DefaultDeviceCheck() : state_(std::make_unique<State>()), outer_(active) {
  {
    std::lock_guard<std::mutex> lock(registration_mutex);
    if (checks++ == 0)
      handle =
          at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                    .needsInputs(true)
                                    .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }
  active = this;
  active_state = state_.get();
  depth = 0;
}

DefaultDeviceCheck::~DefaultDeviceCheck() {
  active = outer_;
  active_state = outer_ ? outer_->state_.get() : nullptr;
  std::lock_guard<std::mutex> lock(registration_mutex);
  if (--checks == 0) at::removeCallback(handle);
}

std::vector<std::string> DefaultDeviceCheck::findings() const {
  std::vector<std::string> out;
  for (const auto& what : state_->order) {
    const int n = state_->count.at(what);
    out.push_back(n == 1 ? what : fmt::format("{} ({} times)", what, n));
  }
  return out;
}

}  // namespace fsdpp
