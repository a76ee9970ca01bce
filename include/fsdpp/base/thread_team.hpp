#pragma once
// ThreadTeam: the calling thread and size - 1 threads that live as long as the team, running one
// function each and returning when every one is done. Threads kept from call to call keep their
// thread-local state (OpenMP's settings, MKL's and the attention kernel's buffers, malloc's arena),
// which threads started for each call would build again every time.

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fsdpp {

class ThreadTeam {
 public:
  // size >= 1; the threads start here, and a thread started by a thread inherits its CPU binding
  // and nice value, so make the team where the threads should run as the caller does.
  explicit ThreadTeam(int size);
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }
  // Runs fn(i) for every i in [0, size()): i = 0 on the calling thread, the others on the team's
  // threads, all at once. Returns when all have returned; then rethrows the exception of the
  // lowest-numbered member that threw, if any did.
  void run(const std::function<void(int)>& fn);

 private:
  void loop(int member);

  std::mutex mu_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t round_ = 0;  // counts calls of run(): a thread runs each round's job once
  int running_ = 0;     // the team's threads still running this round's job
  bool stopping_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

}  // namespace fsdpp
