#pragma once
// DefaultDeviceCheck: finds tensors made on the default device inside a region of code.
//
// A tensor factory (at::empty, at::zeros, at::full, at::scalar_tensor, ...) called without a
// device makes its tensor on the CPU whatever device the surrounding work runs on. On a GPU that
// tensor then reaches the device through a synchronising host-to-device copy, which costs a host
// sync every time and which a CUDA graph capture refuses. Such calls look harmless on a CPU, so
// this check makes them visible there: while a DefaultDeviceCheck lives, every factory call made
// directly by the code on its thread (not inside another operator) that leaves the device unset is
// recorded, in forward and in the backward passes that thread runs (on the CPU, autograd runs
// them on the calling thread). Derive options from an input (x.options()) instead.
//
//   fsdpp::DefaultDeviceCheck check;
//   step();
//   for (const auto& f : check.findings()) std::cerr << f << "\n";
//
// The trainer runs its first step under this check when FSDPP_CHECK_DEVICES=1.

#include <memory>
#include <string>
#include <vector>

namespace fsdpp {

class DefaultDeviceCheck {
 public:
  DefaultDeviceCheck();
  ~DefaultDeviceCheck();
  DefaultDeviceCheck(const DefaultDeviceCheck&) = delete;
  DefaultDeviceCheck& operator=(const DefaultDeviceCheck&) = delete;

  // One line per distinct call, in order of first occurrence: the operator, where it ran ("in
  // forward" or "in the backward of <autograd node>"), and how many times.
  std::vector<std::string> findings() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
  DefaultDeviceCheck* outer_;  // an enclosing check on the same thread, restored at the end
};

}  // namespace fsdpp
