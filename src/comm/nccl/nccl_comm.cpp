// The NCCL backend: CommImpl over nccl::Core, ordered against LibTorch's current CUDA stream.
//
// Each operation records an event on the caller's current stream, makes the communicator's
// stream wait for it, enqueues the NCCL call and returns a Work that is already done for the
// host. Work::wait() makes the then-current stream wait for the operation's event, so nothing
// blocks the host and compute that does not read the output overlaps the collective (Note [stream
// ordering] in nccl_core.hpp). Work::is_completed() asks the device: it queries the event recorded
// after the operation, so the flight recorder shows operations in flight, the watchdog sees one
// that hangs, and the pipeline's send budget waits for sends to leave. While an operation has not
// completed, the same query polls NCCL's asynchronous error; on one, the communicator is aborted
// and the operation fails. An operation captured into a CUDA graph has no such query (Note
// [captured operations] in nccl_core.hpp). The watchdog aborts every NCCL communicator before it
// ends the process.
// Tensors an operation reads or writes are marked as used on the
// communicator's stream (recordStream), so the caching allocator does not hand their memory out
// again before the operation has finished, even when the caller drops them at once. Nothing here
// but a barrier's wait synchronises with the host or queries an event, so a whole step may be
// captured in a CUDA graph.
//
// Point-to-point: NCCL has no tags. A send matches the receive that the peer issues in the same
// order on this communicator; the tag only names the message in errors and flight records.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <numeric>
#include <vector>

#include "../backend.hpp"
#include "nccl_core.hpp"

namespace fsdpp::comm::detail {

namespace {

using nccl::Core;
using nccl::EventPtr;

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    default:
      throw CommError(fmt::format("nccl: unsupported dtype {}", c10::toString(t)));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  throw CommError("nccl: unknown reduce op");
}

std::vector<size_t> to_sizes(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

std::vector<size_t> offsets_of(const std::vector<size_t>& counts) {
  std::vector<size_t> off(counts.size(), 0);
  if (!counts.empty()) std::exclusive_scan(counts.begin(), counts.end(), off.begin(), size_t{0});
  return off;
}

// Throws a CommError naming the rank; a free function, so that closures kept in a Work need no
// pointer to the communicator, which may be gone before the Work is waited on.
void check_cuda(cudaError_t e, int rank, int size, const char* what) {
  if (e != cudaSuccess)
    throw CommError(fmt::format("rank {}/{} {}: CUDA error '{}'", rank, size, what, cudaGetErrorString(e)));
}

// The process's live NCCL communicators, which the watchdog aborts before it ends the process
// (one hook for all of them; communicators that are gone drop out as new ones come).
void track_for_abort(const std::shared_ptr<Core>& core) {
  struct Tracked {
    std::mutex mu;
    std::vector<std::weak_ptr<Core>> cores;
  };
  static auto* tracked = [] {
    auto* t = new Tracked;  // used by the watchdog thread, up to the process's end
    add_abort_hook([t] {
      std::lock_guard<std::mutex> lock(t->mu);
      for (const auto& w : t->cores)
        if (auto c = w.lock()) c->abort();
    });
    return t;
  }();
  std::lock_guard<std::mutex> lock(tracked->mu);
  std::erase_if(tracked->cores, [](const std::weak_ptr<Core>& w) { return w.expired(); });
  tracked->cores.push_back(core);
}

class NcclComm final : public CommImpl {
 public:
  explicit NcclComm(std::unique_ptr<Core> core)
      : core_(std::move(core)),
        comm_stream_(c10::cuda::getStreamFromExternal(core_->stream(),
                                                      static_cast<c10::DeviceIndex>(core_->device()))) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    ready_ = EventPtr(e, [](cudaEvent_t ev) { cudaEventDestroy(ev); });
    track_for_abort(core_);
  }

  int rank() const override { return core_->rank(); }
  int size() const override { return core_->size(); }
  const char* backend() const override { return "nccl"; }

  Work all_gather(const at::Tensor& out, const at::Tensor& in, const AllGatherOptions& opts) override {
    const auto type = nccl_type(in.scalar_type());
    auto what = summary("all_gather", in);
    what.in = in.numel(), what.out = out.numel();
    const bool even = opts.counts.empty() || std::all_of(opts.counts.begin(), opts.counts.end(),
                                                         [&](int64_t c) { return c == opts.counts[0]; });
    if (even)
      return run(what, {in, out}, [&](cudaEvent_t ready) {
        return core_->all_gather(in.data_ptr(), out.data_ptr(), size_t(in.numel()), type, ready);
      });
    // Uneven parts: every rank sends its part to every rank, in one NCCL group.
    const auto recv = to_sizes(opts.counts);
    const std::vector<size_t> send(size(), size_t(in.numel())), send_off(size(), 0);
    return run(what, {in, out}, [&](cudaEvent_t ready) {
      return core_->all_to_all(in.data_ptr(), out.data_ptr(), send, send_off, recv, offsets_of(recv), type,
                               ready);
    });
  }

  Work reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                      const ReduceScatterOptions& opts) override {
    auto what = summary("reduce_scatter", in);
    what.reduce = to_string(opts.op), what.in = in.numel(), what.out = out.numel();
    return run(what, {in, out}, [&](cudaEvent_t ready) {
      return core_->reduce_scatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()),
                                   nccl_type(in.scalar_type()), nccl_op(opts.op), ready);
    });
  }

  Work all_reduce(const at::Tensor& t, const AllReduceOptions& opts) override {
    auto what = summary("all_reduce", t);
    what.reduce = to_string(opts.op), what.n = t.numel();
    return run(what, {t}, [&](cudaEvent_t ready) {
      return core_->all_reduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.scalar_type()),
                               nccl_op(opts.op), ready);
    });
  }

  Work broadcast(const at::Tensor& t, const BroadcastOptions& opts) override {
    auto what = summary("broadcast", t);
    what.root = opts.root, what.n = t.numel();
    return run(what, {t}, [&](cudaEvent_t ready) {
      return core_->broadcast(t.data_ptr(), size_t(t.numel()), nccl_type(t.scalar_type()), opts.root, ready);
    });
  }

  Work all_to_all(const at::Tensor& out, const at::Tensor& in, const AllToAllOptions& opts) override {
    auto what = summary("all_to_all", in);
    what.in = in.numel(), what.out = out.numel();
    const size_t n = size_t(size());
    auto send =
        opts.in_splits.empty() ? std::vector<size_t>(n, size_t(in.numel()) / n) : to_sizes(opts.in_splits);
    auto recv =
        opts.out_splits.empty() ? std::vector<size_t>(n, size_t(out.numel()) / n) : to_sizes(opts.out_splits);
    return run(what, {in, out}, [&](cudaEvent_t ready) {
      return core_->all_to_all(in.data_ptr(), out.data_ptr(), send, offsets_of(send), recv, offsets_of(recv),
                               nccl_type(in.scalar_type()), ready);
    });
  }

  Work p2p(const std::vector<P2POp>& ops) override {
    std::string what = fmt::format("rank {}/{} ", rank(), size());
    std::vector<Core::P2p> group;
    std::vector<at::Tensor> tensors;
    for (const auto& op : ops) {
      const bool send = op.kind == P2POp::Kind::kSend;
      what += (group.empty() ? "" : ", ") + op.describe();
      group.push_back({send, op.tensor.data_ptr(), size_t(op.tensor.numel()),
                       nccl_type(op.tensor.scalar_type()), op.peer});
      tensors.push_back(op.tensor);
    }
    return run(what, tensors, [&](cudaEvent_t ready) { return core_->p2p(group, ready); });
  }

  // Unlike the other operations, waiting for a barrier blocks the host until every rank has reached
  // it (callers use it to order work between processes, such as committing a checkpoint).
  Work barrier() override {
    EventPtr done;
    Work work = run(fmt::format("rank {}/{} barrier", rank(), size()), {}, [&](cudaEvent_t) {
      done = core_->barrier();
      return done;
    });
    if (done)
      work.state()->device_wait = [done, r = rank(), n = size()] {
        check_cuda(cudaEventSynchronize(done.get()), r, n, "barrier");
      };
    return work;
  }

  std::shared_ptr<CommImpl> split(int color, int key) override {
    std::unique_ptr<Core> child;
    try {
      child = core_->split(color, key);
    } catch (const nccl::NcclError& e) {
      throw CommError(e.what());
    }
    if (!child) return nullptr;
    return std::make_shared<NcclComm>(std::move(child));
  }

 private:
  OpSummary summary(const char* op, const at::Tensor& t) const {
    return {.op = op, .rank = rank(), .size = size(), .dtype = t.scalar_type()};
  }

  void check(cudaError_t e, const char* what) const { check_cuda(e, rank(), size(), what); }

  // Orders the operation after the work already on the caller's stream, enqueues it, and returns
  // a Work whose wait() orders the caller's stream after it.
  template <typename What, typename Tensors = std::initializer_list<at::Tensor>, typename F>
  Work run(What&& what, const Tensors& tensors, F&& enqueue) {
    auto state = std::make_shared<WorkState>(std::forward<What>(what));
    state->start();
    const auto device = static_cast<c10::DeviceIndex>(core_->device());
    try {
      const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device).stream();
      const bool captured = nccl::capturing(caller);
      check(cudaEventRecord(ready_.get(), caller), "cudaEventRecord");
      EventPtr done = enqueue(ready_.get());
      for (const auto& t : tensors)
        if (t.defined() && t.numel() > 0)
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), comm_stream_);
      state->device_wait = [done, device, r = rank(), n = size()] {
        check_cuda(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device).stream(), done.get(), 0), r, n,
                   "cudaStreamWaitEvent");
      };
      if (!captured)
        state->device_done = [done, core = std::weak_ptr<Core>(core_), op = std::weak_ptr<WorkState>(state)] {
          return device_done(done.get(), core, op);
        };
      state->finish();
    } catch (const nccl::NcclError& e) {
      // An NCCL failure leaves the communicator unusable; the launcher stops the job.
      note_failure(state->what(), std::current_exception());
      state->finish(std::make_exception_ptr(CommError(e.what())));
    }
    return Work(state);
  }

  // Whether the operation whose completion `done` records has finished on the device (it was not
  // captured: those have no query).
  static bool device_done(cudaEvent_t done, const std::weak_ptr<Core>& core,
                          const std::weak_ptr<WorkState>& op) {
    const auto c = core.lock();
    if (!c) return true;  // the communicator is gone, and destroying it drained its stream
    // The watchdog's thread asks too: in the default (global) capture mode its query would
    // invalidate a capture running on another thread, so this thread's mode is relaxed meanwhile.
    struct RelaxedCapture {
      cudaStreamCaptureMode previous = cudaStreamCaptureModeRelaxed;
      RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&previous); }
      ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&previous); }
    } relaxed;
    const cudaError_t q = cudaEventQuery(done);
    if (q != cudaSuccess && q != cudaErrorNotReady)
      (void)cudaGetLastError();  // not sticky; leave none behind
    const auto completion = nccl::completion_of(q, c->aborted(), c->async_error());
    if (completion != nccl::Completion::kFailed) return completion == nccl::Completion::kDone;
    // The device failed, or NCCL did (a peer gone): the operation will never complete. Abort the
    // communicator so that nothing waits on it forever, and fail the operation.
    const std::string why = q != cudaErrorNotReady ? fmt::format("CUDA error '{}'", cudaGetErrorString(q))
                            : c->aborted()         ? std::string("the communicator was aborted")
                                                   : c->async_error_message();
    c->abort();
    if (const auto state = op.lock()) {
      auto error = std::make_exception_ptr(CommError(why));
      note_failure(state->what(), error);
      state->fail(error);
    }
    return true;
  }

  std::shared_ptr<Core> core_;
  c10::cuda::CUDAStream comm_stream_;
  EventPtr ready_;  // re-recorded by every operation; a stream wait uses the state it had then
};

}  // namespace

bool nccl_available() { return true; }

double cuda_device_memory(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return double(prop.totalGlobalMem);
}

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = fmt::format("cudaGetDeviceCount: {}", cudaGetErrorString(e));
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device is visible";
  return n;
}

std::shared_ptr<CommImpl> make_nccl_comm(std::shared_ptr<Store> store, int rank, int size,
                                         const BackendConfig& config) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    throw CommError(
        fmt::format("rank {}/{}: the NCCL backend needs a CUDA device, and none is visible", rank, size));
  const char* host_id = std::getenv("NCCL_HOSTID");
  if (config.device >= count && !(host_id && *host_id))
    throw CommError(
        fmt::format("rank {}/{}: local rank {} but {} GPU{} visible: NCCL refuses two ranks of one "
                    "communicator on one GPU. "
                    "Start fewer ranks per node, or, for a correctness check only, let ranks share GPUs with "
                    "`fsdpp launch --share-gpu` (or `fsdpp run --share-gpu`), which gives each rank an "
                    "NCCL_HOSTID of its own",
                    rank, size, config.device, count, count == 1 ? " is" : "s are"));
  const int device = config.device >= 0 ? config.device % count : c10::cuda::current_device();
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  nccl::Rendezvous rendezvous{[&](const std::string& k, const std::vector<uint8_t>& v) { store->set(k, v); },
                              [&](const std::string& k) { return store->get(k); }};
  try {
    auto core = std::make_unique<Core>(rank, size, device, rendezvous, "nccl_unique_id", config.timeout);
    return std::make_shared<NcclComm>(std::move(core));
  } catch (const nccl::NcclError& e) {
    throw CommError(e.what());
  }
}

}  // namespace fsdpp::comm::detail
