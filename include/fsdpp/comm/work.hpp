#pragma once
// Work: the handle of one asynchronous operation. wait() blocks until the operation is done and
// rethrows its failure; the tensors it reads or writes are kept alive until then.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fsdpp/comm/types.hpp"

namespace fsdpp::comm {

namespace detail {

// What a collective is, kept as values and put into words only when someone asks (an error, a
// failure note): formatting it for every operation would cost more than a small collective's
// bytes. to_string() gives "rank 1/4 all_gather Float in=10 out=40"; fields left at their
// defaults are left out.
struct OpSummary {
  const char* op = "";
  int rank = 0, size = 0;
  at::ScalarType dtype = at::ScalarType::Undefined;
  const char* reduce = nullptr;  // the reduction ("sum", "avg", ...)
  int root = -1;                 // broadcast's
  int64_t in = -1, out = -1;     // element counts
  int64_t n = -1;                // the element count of an in-place operation
  std::string to_string() const;
};

struct WorkState {
  explicit WorkState(std::string what) : what_(std::move(what)), summary_{} {
    std::call_once(described_, [] {});
  }
  explicit WorkState(const OpSummary& summary) : summary_(summary) {}

  // "rank 1/4 all_gather Float in=10 out=40"; made on first use, from any thread.
  const std::string& what() const {
    std::call_once(described_, [this] { what_ = summary_.to_string(); });
    return what_;
  }

  // Called by the thread that runs the operation as it begins (flight records tell queued from
  // started).
  void start() {
    std::lock_guard<std::mutex> lock(mu);
    started = true;
    started_at = std::chrono::system_clock::now();
  }

  // Called exactly once by the thread that ran the operation.
  void finish(std::exception_ptr failure = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu);
      error = std::move(failure);
      done = true;
      finished_at = std::chrono::system_clock::now();
      tensors.clear();
    }
    cv.notify_all();
  }

  std::mutex mu;
  std::condition_variable cv;
  bool started = false, done = false;
  std::exception_ptr error;
  std::vector<at::Tensor> tensors;  // kept alive while the operation runs
  // Called when an operation that was done for the host fails later, on the device (NCCL's
  // asynchronous errors): wait() rethrows it from then on.
  void fail(std::exception_ptr failure) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = std::move(failure);
  }

  // Set by backends whose operations run on a device stream (NCCL). Such an operation is done, for
  // the host, once it is enqueued; wait() then calls this to make the caller's current stream wait
  // for it, without blocking the host (see Note [stream ordering] in the NCCL backend).
  std::function<void()> device_wait;
  // Set by the same backends, before finish(): whether the device has finished the operation (an
  // event query, which never blocks). Until then the operation is in flight, for is_completed(), the flight recorder
  // and the watchdog, although done for the host.
  std::function<bool()> device_done;
  std::chrono::system_clock::time_point started_at, finished_at;

 private:
  mutable std::string what_;
  mutable std::once_flag described_;
  OpSummary summary_;
};

}  // namespace detail

class Work {
 public:
  Work() = default;  // an already completed, empty operation
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  void wait() const {
    if (!state_) return;
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->done; });
    if (!state_->error) {
      if (state_->device_wait) state_->device_wait();
      return;
    }
    try {
      std::rethrow_exception(state_->error);
    } catch (const std::exception& e) {
      throw CommError(state_->what() + " failed: " + e.what());
    }
  }

  // Whether the operation has finished, on the device too where it runs on one. Never blocks.
  bool is_completed() const {
    if (!state_) return true;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (!state_->done) return false;
      if (state_->error || !state_->device_done) return true;
    }
    // Outside the lock, since it may record a failure through fail(). device_done is set before
    // finish() and never changed after, so reading it once `done` was seen under the lock is safe.
    return state_->device_done();
  }

  const std::shared_ptr<detail::WorkState>& state() const { return state_; }

  const std::string& description() const {
    static const std::string kEmpty = "empty work";
    return state_ ? state_->what() : kEmpty;
  }

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// Waits for every handle, so that all of them finish even when an earlier one failed, then
// rethrows the first failure.
inline void wait_all(const std::vector<Work>& works) {
  std::exception_ptr first;
  for (const auto& w : works) {
    try {
      w.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace fsdpp::comm
