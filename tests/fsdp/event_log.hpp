#pragma once
// An event log for ordering tests, and a communicator decorator that writes each all-gather,
// reduce-scatter and all-reduce into it when issued: tests then check what was issued before which
// compute event.
#include <algorithm>
#include <chrono>
#include <memory>
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
  void clear() {
    std::lock_guard<std::mutex> lock(mu);
    events.clear();
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

// LoggingComm whose reduce-scatters (and, with kAllGathers, all-gathers) complete `delay` after the
// real ones do, logging "RS_done <prefix><unit>" ("AG_done ...") then: a slow network, so that a
// test sees what was computed while one was in flight.
class DelayingComm : public LoggingComm {
 public:
  enum Slowed { kReduceScatters = 1, kAllGathers = 2 };
  DelayingComm(std::shared_ptr<comm::detail::CommImpl> inner, EventLog& log, std::chrono::milliseconds delay,
               std::string prefix = "", int slowed = kReduceScatters)
      : LoggingComm(std::move(inner), log, std::move(prefix)), delay_(delay), slowed_(slowed) {}
  ~DelayingComm() override {
    for (auto& t : threads_) t.join();
  }
  comm::Work reduce_scatter(const at::Tensor& o, const at::Tensor& i,
                            const comm::ReduceScatterOptions& x) override {
    auto real = LoggingComm::reduce_scatter(o, i, x);
    return slowed_ & kReduceScatters ? delayed(std::move(real), "RS_done " + prefix_ + unit()) : real;
  }
  comm::Work all_gather(const at::Tensor& o, const at::Tensor& i, const comm::AllGatherOptions& x) override {
    auto real = LoggingComm::all_gather(o, i, x);
    return slowed_ & kAllGathers ? delayed(std::move(real), "AG_done " + prefix_ + unit()) : real;
  }

 private:
  comm::Work delayed(comm::Work real, std::string done) {
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
  std::chrono::milliseconds delay_;
  int slowed_;
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

// Sends that complete `delay` after the real ones do, on this communicator and on every one split
// from it (the pipeline executor's edges), with the most ever in flight at once: what a send budget
// must bound, seen from the wire rather than from the executor's own count.
class SlowSendComm : public CountingComm {
 public:
  struct Flights {
    explicit Flights(std::chrono::milliseconds d) : delay(d) {}
    ~Flights() {
      for (auto& t : threads) t.join();
    }
    std::chrono::milliseconds delay;
    std::mutex mu;
    int in_flight = 0, peak = 0;
    std::vector<std::thread> threads;
  };
  SlowSendComm(std::shared_ptr<comm::detail::CommImpl> inner, std::shared_ptr<Flights> flights)
      : CountingComm(inner), inner_(std::move(inner)), flights_(std::move(flights)) {}
  // A send (a group with sends counts once: the executor sends one message at a time).
  comm::Work p2p(const std::vector<comm::P2POp>& ops) override {
    auto real = CountingComm::p2p(ops);
    if (std::none_of(ops.begin(), ops.end(),
                     [](const comm::P2POp& op) { return op.kind == comm::P2POp::Kind::kSend; }))
      return real;
    auto state = std::make_shared<comm::detail::WorkState>(real.description());
    state->start();
    std::lock_guard<std::mutex> lock(flights_->mu);
    flights_->peak = std::max(flights_->peak, ++flights_->in_flight);
    flights_->threads.emplace_back([f = flights_.get(), real, state] {
      std::exception_ptr failure;
      try {
        real.wait();
      } catch (...) {
        failure = std::current_exception();
      }
      std::this_thread::sleep_for(f->delay);
      {
        std::lock_guard<std::mutex> lock(f->mu);
        --f->in_flight;
      }
      state->finish(failure);
    });
    return comm::Work(state);
  }
  std::shared_ptr<comm::detail::CommImpl> split(int color, int key) override {
    auto part = inner_->split(color, key);
    return part ? std::make_shared<SlowSendComm>(std::move(part), flights_) : nullptr;
  }

 private:
  std::shared_ptr<comm::detail::CommImpl> inner_;
  std::shared_ptr<Flights> flights_;
};

}  // namespace fsdpp::test
