#pragma once
// A communicator decorator that counts operations by kind, for tests that check how many
// collectives a step issues.
#include <atomic>

#include "dist/comm.hpp"

namespace fsdpp::test {

class CountingComm : public dist::detail::CommImpl {
 public:
  explicit CountingComm(std::shared_ptr<dist::detail::CommImpl> inner) : inner_(std::move(inner)) {}
  std::atomic<int> all_gathers{0}, reduce_scatters{0}, all_reduces{0}, others{0};
  void reset() { all_gathers = reduce_scatters = all_reduces = others = 0; }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend() const override { return inner_->backend(); }
  dist::Work all_gather(const at::Tensor& o, const at::Tensor& i, const dist::AllGatherOptions& x) override {
    ++all_gathers;
    return inner_->all_gather(o, i, x);
  }
  dist::Work reduce_scatter(const at::Tensor& o, const at::Tensor& i,
                            const dist::ReduceScatterOptions& x) override {
    ++reduce_scatters;
    return inner_->reduce_scatter(o, i, x);
  }
  dist::Work all_reduce(const at::Tensor& t, const dist::AllReduceOptions& x) override {
    ++all_reduces;
    return inner_->all_reduce(t, x);
  }
  dist::Work broadcast(const at::Tensor& t, const dist::BroadcastOptions& x) override {
    ++others;
    return inner_->broadcast(t, x);
  }
  dist::Work all_to_all(const at::Tensor& o, const at::Tensor& i, const dist::AllToAllOptions& x) override {
    ++others;
    return inner_->all_to_all(o, i, x);
  }
  dist::Work send(const at::Tensor& t, int d, uint32_t tag) override {
    ++others;
    return inner_->send(t, d, tag);
  }
  dist::Work recv(const at::Tensor& t, int s, uint32_t tag) override {
    ++others;
    return inner_->recv(t, s, tag);
  }
  dist::Work barrier() override {
    ++others;
    return inner_->barrier();
  }
  std::shared_ptr<dist::detail::CommImpl> split(int color, int key) override {
    return inner_->split(color, key);
  }

 private:
  std::shared_ptr<dist::detail::CommImpl> inner_;
};

}  // namespace fsdpp::test
