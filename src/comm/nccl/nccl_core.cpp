#include "nccl_core.hpp"

#include <cstring>
#include <algorithm>
#include <mutex>
#include <thread>
#include <sstream>

namespace fsdpp::comm::nccl {

namespace {

std::string prefix(int rank, int size, const char* what) {
  std::ostringstream os;
  os << "rank " << rank << "/" << size << " " << what << ": ";
  return os.str();
}

// Errors before a communicator exists (no rank context from NCCL yet).
void check_init(cudaError_t e, int rank, int size, const char* what) {
  if (e != cudaSuccess)
    throw NcclError(prefix(rank, size, what) + "CUDA error '" + cudaGetErrorString(e) + "'");
}
void check_init(ncclResult_t r, int rank, int size, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw NcclError(prefix(rank, size, what) + "NCCL error '" + ncclGetErrorString(r) + "'");
}

}  // namespace

// Events recorded after each operation, reused: creating and destroying one per operation costs a
// driver call each, on the path of every collective.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  ~EventPool() {
    for (auto e : free_) cudaEventDestroy(e);
  }
  cudaError_t take(EventPtr& out) {
    cudaEvent_t e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        e = free_.back();
        free_.pop_back();
      }
    }
    if (!e)
      if (const auto err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); err != cudaSuccess)
        return err;
    // The pool outlives every event it handed out: each holds it.
    out = EventPtr(e, [pool = shared_from_this()](cudaEvent_t ev) { pool->give_back(ev); });
    return cudaSuccess;
  }

 private:
  void give_back(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(e);
  }
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

Completion completion_of(cudaError_t query, bool aborted, ncclResult_t async_error) {
  if (query == cudaSuccess || query == cudaErrorCapturedEvent) return Completion::kDone;
  const bool nccl_fine = async_error == ncclSuccess || async_error == ncclInProgress;
  if (query == cudaErrorNotReady && !aborted && nccl_fine) return Completion::kInFlight;
  return Completion::kFailed;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: leave no error behind for the next CUDA call to report
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

size_t Core::element_size(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      throw NcclError("nccl: unsupported data type " + std::to_string(static_cast<int>(type)));
  }
}

Core::Core(int rank, int size, int device, const Rendezvous& rendezvous, const std::string& key,
           std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), device_(device), timeout_(timeout), events_(std::make_shared<EventPool>()) {
  check_init(cudaSetDevice(device), rank, size, "cudaSetDevice");
  ncclUniqueId id;
  if (rank == 0) {
    check_init(ncclGetUniqueId(&id), rank, size, "ncclGetUniqueId");
    rendezvous.set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                             reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
  } else {
    const auto bytes = rendezvous.get(key);
    if (bytes.size() != sizeof(id))
      throw NcclError(prefix(rank, size, "rendezvous") + "the NCCL unique id under '" + key + "' has " +
                      std::to_string(bytes.size()) + " bytes, expected " + std::to_string(sizeof(id)));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  check_init(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), rank, size, "cudaStreamCreate");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Note [non-blocking communicators]
  const ncclResult_t r = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  check_init(r, rank, size, "ncclCommInitRankConfig");
  settle(r, "ncclCommInitRankConfig");
  check(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
  check(cudaMemsetAsync(scratch_, 0, sizeof(float), stream_), "cudaMemsetAsync");
}

Core::Core(int rank, int size, int device, ncclComm_t comm, std::chrono::milliseconds timeout)
    : rank_(rank),
      size_(size),
      device_(device),
      timeout_(timeout),
      events_(std::make_shared<EventPool>()),
      comm_(comm) {
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
  check(cudaMemsetAsync(scratch_, 0, sizeof(float), stream_), "cudaMemsetAsync");
}

Core::~Core() {
  // Errors cannot leave a destructor. An aborted communicator's stream may never drain, so it is
  // neither synchronised nor destroyed again.
  if (!aborted_.load()) {
    if (stream_) cudaStreamSynchronize(stream_);
    if (comm_) {
      // Finalising a non-blocking communicator may go on in the background: wait for it, within
      // the timeout, then destroy (an abort where it did not finish).
      bool finalized = false;
      try {
        settle(ncclCommFinalize(comm_), "ncclCommFinalize");
        finalized = true;
      } catch (const NcclError&) {
      }
      if (finalized)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    }
  }
  if (scratch_) cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(stream_);
}

ncclResult_t Core::async_error() const {
  if (!comm_ || aborted_.load()) return ncclSuccess;
  // ncclInProgress while a call is finishing in the background (Note [non-blocking communicators]).
  ncclResult_t result = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) return ncclSystemError;
  return result;
}

std::string Core::async_error_message() const {
  const auto r = async_error();
  std::string msg = prefix(rank_, size_, "communicator") + "NCCL error '" + ncclGetErrorString(r) + "'";
  if (const char* last = comm_ ? ncclGetLastError(comm_) : nullptr; last && *last)
    msg += " (" + std::string(last) + ")";
  return msg;
}

void Core::abort() {
  if (!comm_ || aborted_.exchange(true)) return;
  ncclCommAbort(comm_);
}

void Core::check(cudaError_t e, const char* what) const {
  if (e != cudaSuccess)
    throw NcclError(prefix(rank_, size_, what) + "CUDA error '" + cudaGetErrorString(e) + "'");
}

void Core::check(ncclResult_t r, const char* what) const {
  if (r == ncclSuccess) return;
  std::string msg = prefix(rank_, size_, what) + "NCCL error '" + ncclGetErrorString(r) + "'";
  if (comm_)
    if (const char* last = ncclGetLastError(comm_); last && *last) msg += " (" + std::string(last) + ")";
  throw NcclError(msg);
}

void Core::settle(ncclResult_t r, const char* what) const {
  if (r != ncclInProgress) return check(r, what);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  auto pause = std::chrono::microseconds(1);
  for (;;) {
    if (aborted_.load())
      throw NcclError(prefix(rank_, size_, what) +
                      "the communicator was aborted while the call was in progress");
    ncclResult_t state = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &state), what);
    if (state != ncclInProgress) return check(state, what);
    if (std::chrono::steady_clock::now() >= deadline)
      throw NcclError(prefix(rank_, size_, what) + "still in progress after " +
                      std::to_string(timeout_.count() / 1000.0) + " s (is every rank making this call?)");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void Core::wait_for(cudaEvent_t ready, const char* what) {
  if (aborted_.load())
    throw NcclError(prefix(rank_, size_, what) + "the communicator was aborted after an earlier failure");
  check(cudaSetDevice(device_), what);
  if (ready) check(cudaStreamWaitEvent(stream_, ready, 0), what);
}

EventPtr Core::finished(const char* what) {
  EventPtr event;
  check(events_->take(event), what);
  check(cudaEventRecord(event.get(), stream_), what);
  return event;
}

std::unique_ptr<Core> Core::split(int color, int key) {
  ncclComm_t child = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Note [non-blocking communicators]
  const ncclResult_t r = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config);
  if (color < 0 || !child) {
    settle(r, "ncclCommSplit");
    return nullptr;
  }
  // The new communicator's state tells when the split has finished.
  auto core = std::unique_ptr<Core>(new Core(rank_, size_, device_, child, timeout_));
  core->settle(r, "ncclCommSplit");
  check(ncclCommUserRank(child, &core->rank_), "ncclCommUserRank");
  check(ncclCommCount(child, &core->size_), "ncclCommCount");
  return core;
}

EventPtr Core::all_gather(const void* in, void* out, size_t count, ncclDataType_t type, cudaEvent_t ready) {
  wait_for(ready, "all_gather");
  settle(ncclAllGather(in, out, count, type, comm_, stream_), "all_gather");
  return finished("all_gather");
}

EventPtr Core::reduce_scatter(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                              cudaEvent_t ready) {
  wait_for(ready, "reduce_scatter");
  settle(ncclReduceScatter(in, out, count, type, op, comm_, stream_), "reduce_scatter");
  return finished("reduce_scatter");
}

EventPtr Core::all_reduce(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                          cudaEvent_t ready) {
  wait_for(ready, "all_reduce");
  settle(ncclAllReduce(in, out, count, type, op, comm_, stream_), "all_reduce");
  return finished("all_reduce");
}

EventPtr Core::broadcast(void* buffer, size_t count, ncclDataType_t type, int root, cudaEvent_t ready) {
  wait_for(ready, "broadcast");
  settle(ncclBroadcast(buffer, buffer, count, type, root, comm_, stream_), "broadcast");
  return finished("broadcast");
}

EventPtr Core::all_to_all(const void* in, void* out, const std::vector<size_t>& send_counts,
                          const std::vector<size_t>& send_offsets, const std::vector<size_t>& recv_counts,
                          const std::vector<size_t>& recv_offsets, ncclDataType_t type, cudaEvent_t ready) {
  wait_for(ready, "all_to_all");
  const size_t es = element_size(type);
  check(ncclGroupStart(), "all_to_all");
  for (int p = 0; p < size_; ++p) {
    const auto* src = static_cast<const char*>(in) + send_offsets[p] * es;
    auto* dst = static_cast<char*>(out) + recv_offsets[p] * es;
    if (send_counts[p]) check(ncclSend(src, send_counts[p], type, p, comm_, stream_), "all_to_all");
    if (recv_counts[p]) check(ncclRecv(dst, recv_counts[p], type, p, comm_, stream_), "all_to_all");
  }
  settle(ncclGroupEnd(), "all_to_all");
  return finished("all_to_all");
}

EventPtr Core::p2p(const std::vector<P2p>& ops, cudaEvent_t ready) {
  wait_for(ready, "p2p");
  check(ncclGroupStart(), "p2p");
  for (const auto& op : ops) {
    if (op.send)
      check(ncclSend(op.buffer, op.count, op.type, op.peer, comm_, stream_), "send");
    else
      check(ncclRecv(op.buffer, op.count, op.type, op.peer, comm_, stream_), "recv");
  }
  settle(ncclGroupEnd(), "p2p");
  return finished("p2p");
}

EventPtr Core::barrier() {
  wait_for(nullptr, "barrier");
  settle(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_), "barrier");
  return finished("barrier");
}

}  // namespace fsdpp::comm::nccl
