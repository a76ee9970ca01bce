#pragma once
// Comm: one communicator. Every operation is asynchronous and returns a Work; operations on one
// communicator run in the order they were issued, like a CUDA stream, so callers may issue many
// and wait later. Collectives must be issued by every rank in the same order. On a CPU
// communicator of one rank, every operation completes where it is issued and returns an empty Work.
//
// Layouts are flat and rank-major: all_gather writes rank r's contribution at slot r of `out`
// (and `in` may be a view of that slot, which avoids a copy), reduce_scatter reads slot r of `in`
// from every rank into rank r's `out`. Supported dtypes: float32, float64, bfloat16, float16,
// int32, int64, uint8. Reductions of 16-bit floats accumulate in float32, and every rank receives
// the same bits.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdpp/comm/types.hpp"
#include "fsdpp/comm/work.hpp"

namespace fsdpp::comm {

class Comm;
class FlightRecorder;

// One send or receive of a group (Comm::batch_p2p).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;
  int peer = -1;
  uint32_t tag = 0;
  static P2POp send(at::Tensor t, int dst, uint32_t tag = 0) { return {Kind::kSend, std::move(t), dst, tag}; }
  static P2POp recv(at::Tensor t, int src, uint32_t tag = 0) { return {Kind::kRecv, std::move(t), src, tag}; }
  // "send to rank 1 tag 3 Float n=6", as errors and descriptions name it.
  std::string describe() const {
    return std::string(kind == Kind::kSend ? "send to" : "recv from") + " rank " + std::to_string(peer) +
           " tag " + std::to_string(tag) + " " + c10::toString(tensor.scalar_type()) +
           " n=" + std::to_string(tensor.numel());
  }
};

namespace detail {

// What a backend provides. Arguments arrive validated (see comm.cpp): contiguous tensors of a
// supported dtype on the backend's device, with consistent sizes.
class CommImpl {
 public:
  virtual ~CommImpl() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;
  virtual Work all_gather(const at::Tensor& out, const at::Tensor& in, const AllGatherOptions& opts) = 0;
  virtual Work reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                              const ReduceScatterOptions& opts) = 0;
  virtual Work all_reduce(const at::Tensor& t, const AllReduceOptions& opts) = 0;
  virtual Work broadcast(const at::Tensor& t, const BroadcastOptions& opts) = 0;
  virtual Work all_to_all(const at::Tensor& out, const at::Tensor& in, const AllToAllOptions& opts) = 0;
  // Sends and receives that progress together (one of them alone is Comm::send or Comm::recv); the
  // Work completes when all of them have.
  virtual Work p2p(const std::vector<P2POp>& ops) = 0;
  virtual Work barrier() = 0;
  // Collective over this communicator; returns null for ranks with a negative color.
  virtual std::shared_ptr<CommImpl> split(int color, int key) = 0;
};

}  // namespace detail

class Comm {
 public:
  Comm() = default;  // not a member of any group (what split returns for a negative color)
  // `name` identifies the communicator in flight records ("world", "world/split0.1").
  explicit Comm(std::shared_ptr<detail::CommImpl> impl, const std::string& name = "comm");

  explicit operator bool() const { return impl_ != nullptr; }
  int rank() const {
    if (!impl_) throw_empty();
    return rank_;
  }
  int size() const {
    if (!impl_) throw_empty();
    return size_;
  }
  const char* backend() const;

  Work all_gather(const at::Tensor& out, const at::Tensor& in, AllGatherOptions opts = {});
  Work reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceScatterOptions opts = {});
  Work all_reduce(const at::Tensor& t, AllReduceOptions opts = {});
  Work broadcast(const at::Tensor& t, BroadcastOptions opts = {});
  Work all_to_all(const at::Tensor& out, const at::Tensor& in, AllToAllOptions opts = {});
  // Point-to-point. A send matches the receive on `dst` with the same tag; messages between two
  // ranks with the same tag arrive in the order they were sent.
  //
  // Note [point-to-point groups]
  // On NCCL a communicator runs its operations one after another on one stream, and a send or a
  // receive holds that stream until its peer reaches the matching operation: a rank that issues
  // recv(left) then send(right) while its neighbours do the same waits forever (Gloo's
  // asynchronous transport hides this). Sends and receives that must progress together go into
  // one batch_p2p call, PyTorch's batch_isend_irecv: one NCCL group on CUDA, plain asynchronous
  // operations on Gloo. Separate communicators (one per direction) are the other way out. Run with
  // FSDPP_CHECK_NCCL_ORDER=1 to have a CPU communicator refuse what NCCL would not run
  // (docs/comm.md).
  Work send(const at::Tensor& t, int dst, uint32_t tag = 0);
  Work recv(const at::Tensor& t, int src, uint32_t tag = 0);
  // One Work for the whole group, complete when every operation in it is.
  Work batch_p2p(const std::vector<P2POp>& ops);
  Work barrier();

  // Collective: ranks passing the same color form a new communicator, ordered by (key, rank).
  // A negative color takes part in the split but returns an empty Comm.
  Comm split(int color, int key) const;

  // The backend behind this communicator, for decorators (for example one that counts operations:
  // Comm(std::make_shared<Counting>(comm.impl_ptr()))).
  const std::shared_ptr<detail::CommImpl>& impl_ptr() const { return impl_; }
  // Consistency checking (off by default; FSDPP_CHECK_COLLECTIVES=1 turns it on): before each
  // collective, the ranks compare what they are about to issue and fail at once, naming both
  // sides, when they differ. Costs one small all-gather per collective.
  void set_consistency_check(bool on);

  // This communicator's flight recorder (fsdpp/comm/flight_recorder.hpp); null for an empty Comm.
  const std::shared_ptr<FlightRecorder>& recorder() const { return recorder_; }

 private:
  class Checker;  // argument checks (comm.cpp)
  detail::CommImpl& impl() const;
  [[noreturn]] static void throw_empty();
  // Issues the operation (`issue()` returns its Work) and records it, with the time it was issued.
  template <typename Issue>
  Work recorded(const char* op, const at::Tensor* in, const at::Tensor* out, int peer, Issue&& issue);
  void check_consistency(int op, const at::Tensor* in, const at::Tensor* out, int64_t extra);
  std::shared_ptr<detail::CommImpl> impl_;
  std::shared_ptr<FlightRecorder> recorder_;
  std::shared_ptr<bool> check_;  // shared by copies of this Comm
  // The backend's, which never change, read once: every operation's argument checks use them.
  int rank_ = -1, size_ = 0;
  bool takes_cuda_ = false;  // NCCL's communicators take CUDA tensors; Gloo's, CPU tensors
};

}  // namespace fsdpp::comm
