#pragma once
// A communicator decorator that counts operations by kind, for tests that check how many
// collectives a step issues, and records the dtype each reduce-scatter carries.
#include <atomic>
#include <mutex>
#include <vector>

#include "fsdpp/comm/comm.hpp"

namespace fsdpp::test {

class CountingComm : public comm::detail::CommImpl {
 public:
  explicit CountingComm(std::shared_ptr<comm::detail::CommImpl> inner) : inner_(std::move(inner)) {}
  std::atomic<int> all_gathers{0}, reduce_scatters{0}, all_reduces{0}, others{0};
  void reset() {
    all_gathers = reduce_scatters = all_reduces = others = 0;
    std::lock_guard lock(mutex_);
    reduce_scatter_dtypes_.clear();
  }
  std::vector<at::ScalarType> reduce_scatter_dtypes() const {
    std::lock_guard lock(mutex_);
    return reduce_scatter_dtypes_;
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend() const override { return inner_->backend(); }
  comm::Work all_gather(const at::Tensor& o, const at::Tensor& i, const comm::AllGatherOptions& x) override {
    ++all_gathers;
    return inner_->all_gather(o, i, x);
  }
  comm::Work reduce_scatter(const at::Tensor& o, const at::Tensor& i,
                            const comm::ReduceScatterOptions& x) override {
    ++reduce_scatters;
    {
      std::lock_guard lock(mutex_);
      reduce_scatter_dtypes_.push_back(i.scalar_type());
    }
    return inner_->reduce_scatter(o, i, x);
  }
  comm::Work all_reduce(const at::Tensor& t, const comm::AllReduceOptions& x) override {
    ++all_reduces;
    return inner_->all_reduce(t, x);
  }
  comm::Work broadcast(const at::Tensor& t, const comm::BroadcastOptions& x) override {
    ++others;
    return inner_->broadcast(t, x);
  }
  comm::Work all_to_all(const at::Tensor& o, const at::Tensor& i, const comm::AllToAllOptions& x) override {
    ++others;
    return inner_->all_to_all(o, i, x);
  }
  comm::Work p2p(const std::vector<comm::P2POp>& ops) override {
    ++others;
    return inner_->p2p(ops);
  }
  comm::Work barrier() override {
    ++others;
    return inner_->barrier();
  }
  std::shared_ptr<comm::detail::CommImpl> split(int color, int key) override {
    return inner_->split(color, key);
  }

 private:
  std::shared_ptr<comm::detail::CommImpl> inner_;
  mutable std::mutex mutex_;
  std::vector<at::ScalarType> reduce_scatter_dtypes_;
};

}  // namespace fsdpp::test
