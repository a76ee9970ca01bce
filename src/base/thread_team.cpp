#include "fsdpp/base/thread_team.hpp"

#include <stdexcept>
#include <string>

namespace fsdpp {

ThreadTeam::ThreadTeam(int size) {
  if (size < 1)
    throw std::invalid_argument("ThreadTeam: size must be at least 1, got " + std::to_string(size));
  errors_.resize(size);
  threads_.reserve(size - 1);
  for (int i = 1; i < size; ++i) threads_.emplace_back([this, i] { loop(i); });
}

ThreadTeam::~ThreadTeam() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadTeam::run(const std::function<void(int)>& fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    running_ = static_cast<int>(threads_.size());
    for (auto& e : errors_) e = nullptr;
    ++round_;
  }
  start_.notify_all();
  try {
    fn(0);
  } catch (...) {
    errors_[0] = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return running_ == 0; });
  job_ = nullptr;
  for (const auto& e : errors_)
    if (e) std::rethrow_exception(e);
}

void ThreadTeam::loop(int member) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_.wait(lock, [&] { return stopping_ || round_ != seen; });
      if (stopping_) return;
      seen = round_;
      job = job_;
    }
    std::exception_ptr error;
    try {
      (*job)(member);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      errors_[member] = error;
      if (--running_ == 0) done_.notify_one();
    }
  }
}

}  // namespace fsdpp
