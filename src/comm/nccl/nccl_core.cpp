#include "nccl_core.hpp"

#include <cstring>
#include <mutex>
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
  if (query == cudaErrorNotReady && !aborted && async_error == ncclSuccess) return Completion::kInFlight;
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

Core::Core(int rank, int size, int device, const Rendezvous& rendezvous, const std::string& key)
    : rank_(rank), size_(size), device_(device), events_(std::make_shared<EventPool>()) {
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
  check_init(ncclCommInitRank(&comm_, size, id, rank), rank, size, "ncclCommInitRank");
  check(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
  check(cudaMemsetAsync(scratch_, 0, sizeof(float), stream_), "cudaMemsetAsync");
}

Core::Core(int rank, int size, int device, ncclComm_t comm)
    : rank_(rank), size_(size), device_(device), events_(std::make_shared<EventPool>()), comm_(comm) {
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
    if (comm_) ncclCommDestroy(comm_);
  }
  if (scratch_) cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(stream_);
}

ncclResult_t Core::async_error() const {
  if (!comm_ || aborted_.load()) return ncclSuccess;
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
  check(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config), "ncclCommSplit");
  if (color < 0 || !child) return nullptr;
  int rank = 0, size = 0;
  check(ncclCommUserRank(child, &rank), "ncclCommUserRank");
  check(ncclCommCount(child, &size), "ncclCommCount");
  return std::unique_ptr<Core>(new Core(rank, size, device_, child));
}

EventPtr Core::all_gather(const void* in, void* out, size_t count, ncclDataType_t type, cudaEvent_t ready) {
  wait_for(ready, "all_gather");
  check(ncclAllGather(in, out, count, type, comm_, stream_), "all_gather");
  return finished("all_gather");
}

EventPtr Core::reduce_scatter(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                              cudaEvent_t ready) {
  wait_for(ready, "reduce_scatter");
  check(ncclReduceScatter(in, out, count, type, op, comm_, stream_), "reduce_scatter");
  return finished("reduce_scatter");
}

EventPtr Core::all_reduce(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                          cudaEvent_t ready) {
  wait_for(ready, "all_reduce");
  check(ncclAllReduce(in, out, count, type, op, comm_, stream_), "all_reduce");
  return finished("all_reduce");
}

EventPtr Core::broadcast(void* buffer, size_t count, ncclDataType_t type, int root, cudaEvent_t ready) {
  wait_for(ready, "broadcast");
  check(ncclBroadcast(buffer, buffer, count, type, root, comm_, stream_), "broadcast");
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
  check(ncclGroupEnd(), "all_to_all");
  return finished("all_to_all");
}

EventPtr Core::send(const void* buffer, size_t count, ncclDataType_t type, int peer, cudaEvent_t ready) {
  wait_for(ready, "send");
  check(ncclSend(buffer, count, type, peer, comm_, stream_), "send");
  return finished("send");
}

EventPtr Core::recv(void* buffer, size_t count, ncclDataType_t type, int peer, cudaEvent_t ready) {
  wait_for(ready, "recv");
  check(ncclRecv(buffer, count, type, peer, comm_, stream_), "recv");
  return finished("recv");
}

EventPtr Core::barrier() {
  wait_for(nullptr, "barrier");
  check(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_), "barrier");
  return finished("barrier");
}

}  // namespace fsdpp::comm::nccl
