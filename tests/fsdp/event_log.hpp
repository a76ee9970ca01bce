#pragma once
// An event log for ordering tests, and a communicator decorator that writes each all-gather,
// reduce-scatter and all-reduce into it when issued: tests then check what was issued before which
// compute event.
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdp/counting_comm.hpp"

namespace fsdpp::test {

struct EventLog {
  std::mutex mu;
  std::vector<std::string> events;
  void add(std::string e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(std::move(e));
  }
  // Position of the n-th (0-based) event equal to `e`, or -1.
  long find(const std::string& e, int n = 0) {
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < events.size(); ++i)
      if (events[i] == e && n-- == 0) return static_cast<long>(i);
    return -1;
  }
  std::string dump() {
    std::lock_guard<std::mutex> lock(mu);
    std::string s;
    for (const auto& e : events) s += e + "; ";
    return s;
  }
};

// Logs each all-gather, reduce-scatter and all-reduce when it is issued, named by the unit (the
// last word of the operation's label, "blocks.2"), after `prefix` when one is given.
class LoggingComm : public CountingComm {
 public:
  LoggingComm(std::shared_ptr<comm::detail::CommImpl> inner, EventLog& log, std::string prefix = "")
      : CountingComm(std::move(inner)), log_(log), prefix_(std::move(prefix)) {}
  comm::Work all_gather(const at::Tensor& o, const at::Tensor& i, const comm::AllGatherOptions& x) override {
    log_.add("AG " + prefix_ + unit());
    return CountingComm::all_gather(o, i, x);
  }
  comm::Work reduce_scatter(const at::Tensor& o, const at::Tensor& i,
                            const comm::ReduceScatterOptions& x) override {
    log_.add("RS " + prefix_ + unit());
    return CountingComm::reduce_scatter(o, i, x);
  }
  comm::Work all_reduce(const at::Tensor& t, const comm::AllReduceOptions& x) override {
    log_.add("AR " + prefix_ + unit());
    return CountingComm::all_reduce(t, x);
  }

 protected:
  static std::string unit() {
    const auto& label = comm::OpLabel::current();
    return label.substr(label.find_last_of(' ') + 1);
  }
  EventLog& log_;
  std::string prefix_;
};

// LoggingComm whose reduce-scatters complete `delay` after the real one does, logging "RS_done
// <prefix><unit>" then: a slow network, so that a test sees what was computed while one was in flight.
class DelayingComm : public LoggingComm {
 public:
  DelayingComm(std::shared_ptr<comm::detail::CommImpl> inner, EventLog& log, std::chrono::milliseconds delay,
               std::string prefix = "")
      : LoggingComm(std::move(inner), log, std::move(prefix)), delay_(delay) {}
  ~DelayingComm() override {
    for (auto& t : threads_) t.join();
  }
  comm::Work reduce_scatter(const at::Tensor& o, const at::Tensor& i,
                            const comm::ReduceScatterOptions& x) override {
    const std::string done = "RS_done " + prefix_ + unit();
    auto real = LoggingComm::reduce_scatter(o, i, x);
    auto state = std::make_shared<comm::detail::WorkState>(real.description());
    state->start();
    std::lock_guard<std::mutex> lock(mu_);
    threads_.emplace_back([this, real, state, done] {
      std::exception_ptr failure;
      try {
        real.wait();
      } catch (...) {
        failure = std::current_exception();
      }
      std::this_thread::sleep_for(delay_);
      log_.add(done);
      state->finish(failure);
    });
    return comm::Work(state);
  }

 private:
  std::chrono::milliseconds delay_;
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

}  // namespace fsdpp::test
