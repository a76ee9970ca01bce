#pragma once
// Receive buffers as the CPU allocator sees them (Note [received tensors] in
// src/pipeline/executor.cpp). While a CountingCpuAllocator scope is alive, every CPU block goes
// through a counting allocator that tells the ledger when it is handed out and when it is freed;
// a ReceiveMarkingComm around a communicator (and every communicator split from it) tells the
// ledger which blocks its receives write into, for which rank. The ledger then knows the bytes of
// received blocks each rank has alive, whoever holds them (the executor's slots, autograd's saved
// tensors, a buffer allocated ahead), and records the most at each receive and when asked.
#include <c10/core/CPUAllocator.h>

#include <map>
#include <mutex>
#include <unordered_map>

#include "fsdpp/comm/comm.hpp"

namespace fsdpp::test {

class ReceiveLedger {
 public:
  static ReceiveLedger& get() {
    static ReceiveLedger ledger;
    return ledger;
  }
  void reset() {
    std::lock_guard lock(mutex_);
    for (auto& [p, b] : blocks_) b.rank = -1;
    peak_.clear();
    unknown_ = 0;
  }
  void allocated(const void* p, size_t bytes) {
    std::lock_guard lock(mutex_);
    blocks_[p] = {bytes, -1};
  }
  void freed(const void* p) {
    std::lock_guard lock(mutex_);
    blocks_.erase(p);
  }
  void received_into(const void* p, int rank) {
    std::lock_guard lock(mutex_);
    const auto it = blocks_.find(p);
    if (it == blocks_.end()) {
      ++unknown_;  // a block the counting allocator did not hand out: the test would miss it
      return;
    }
    it->second.rank = rank;
    sample_locked(rank);
  }
  // Records `rank`'s received bytes alive now.
  void sample(int rank) {
    std::lock_guard lock(mutex_);
    sample_locked(rank);
  }
  int64_t peak(int rank) {
    std::lock_guard lock(mutex_);
    return peak_[rank];
  }
  int unknown() {
    std::lock_guard lock(mutex_);
    return unknown_;
  }

 private:
  struct Block {
    size_t bytes;
    int rank;  // the rank that received into it; -1: none
  };
  void sample_locked(int rank) {
    int64_t live = 0;
    for (const auto& [p, b] : blocks_)
      if (b.rank == rank) live += int64_t(b.bytes);
    peak_[rank] = std::max(peak_[rank], live);
  }
  std::mutex mutex_;
  std::unordered_map<const void*, Block> blocks_;
  std::map<int, int64_t> peak_;
  int unknown_ = 0;
};

// Installs a counting CPU allocator over the current one for its lifetime (LibTorch's CPU allocator
// registry, by priority); blocks it handed out tell the ledger when they are freed, even after it.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  CountingCpuAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~CountingCpuAllocator() override { c10::SetCPUAllocator(inner_, kPriority); }
  CountingCpuAllocator(const CountingCpuAllocator&) = delete;
  CountingCpuAllocator& operator=(const CountingCpuAllocator&) = delete;

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (!data) return inner;
    const c10::Device device = inner.device();
    ReceiveLedger::get().allocated(data, n);
    return {data, new c10::DataPtr(std::move(inner)), &release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static constexpr uint8_t kPriority = 100;
  static void release(void* ctx) {
    auto* inner = static_cast<c10::DataPtr*>(ctx);
    ReceiveLedger::get().freed(inner->get());
    delete inner;
  }
  c10::Allocator* inner_;
};

// Forwards everything to `inner`; each receive tells the ledger its block, as `owner`'s.
class ReceiveMarkingComm : public comm::detail::CommImpl {
 public:
  ReceiveMarkingComm(std::shared_ptr<comm::detail::CommImpl> inner, int owner)
      : inner_(std::move(inner)), owner_(owner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend() const override { return inner_->backend(); }
  comm::Work all_gather(const at::Tensor& o, const at::Tensor& i, const comm::AllGatherOptions& x) override {
    return inner_->all_gather(o, i, x);
  }
  comm::Work reduce_scatter(const at::Tensor& o, const at::Tensor& i,
                            const comm::ReduceScatterOptions& x) override {
    return inner_->reduce_scatter(o, i, x);
  }
  comm::Work all_reduce(const at::Tensor& t, const comm::AllReduceOptions& x) override {
    return inner_->all_reduce(t, x);
  }
  comm::Work broadcast(const at::Tensor& t, const comm::BroadcastOptions& x) override {
    return inner_->broadcast(t, x);
  }
  comm::Work all_to_all(const at::Tensor& o, const at::Tensor& i, const comm::AllToAllOptions& x) override {
    return inner_->all_to_all(o, i, x);
  }
  comm::Work p2p(const std::vector<comm::P2POp>& ops) override {
    for (const auto& op : ops)
      if (op.kind == comm::P2POp::Kind::kRecv)
        ReceiveLedger::get().received_into(op.tensor.storage().data(), owner_);
    return inner_->p2p(ops);
  }
  comm::Work barrier() override { return inner_->barrier(); }
  std::shared_ptr<comm::detail::CommImpl> split(int color, int key) override {
    auto child = inner_->split(color, key);
    return child ? std::make_shared<ReceiveMarkingComm>(std::move(child), owner_) : nullptr;
  }

 private:
  std::shared_ptr<comm::detail::CommImpl> inner_;
  int owner_;
};

}  // namespace fsdpp::test
