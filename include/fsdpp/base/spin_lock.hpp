#pragma once
// A lock for short critical sections taken on every step's hot path, mostly by one thread: an
// uncontended std::mutex's lock and unlock cost several times the few stores they guard. A thread
// that finds it taken yields, in case the holder was preempted. Meets BasicLockable, so
// std::lock_guard<SpinLock> serves.

#include <atomic>
#include <thread>

namespace fsdpp {

class SpinLock {
 public:
  void lock() {
    while (busy_.exchange(true, std::memory_order_acquire))
      while (busy_.load(std::memory_order_relaxed)) std::this_thread::yield();
  }
  void unlock() { busy_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> busy_{false};
};

}  // namespace fsdpp
