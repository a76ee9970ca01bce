#pragma once
// The NCCL backend's core: one NCCL communicator and the CUDA stream its operations run on. It
// needs only the CUDA runtime and NCCL (no LibTorch), so it compiles and links on machines without
// a GPU or a CUDA-enabled LibTorch; nccl_comm.cpp adapts it to CommImpl with LibTorch's streams.
//
// Note [stream ordering]
// Every operation first makes the communicator's stream wait for `ready` (an event the caller
// recorded on the stream that produced the input), then enqueues the NCCL call, then records and
// returns an event. Whoever reads the output makes its own stream wait for that event. So the
// host never blocks, collectives overlap compute, and operations on one communicator run in issue
// order, as on the Gloo backend's worker thread.
//
// Note [non-blocking communicators]
// Communicators are created non-blocking (ncclConfig_t::blocking = 0), as PyTorch creates them: an
// NCCL call may then return ncclInProgress and finish in the background, and the host polls
// ncclCommGetAsyncError until it has (settle()). So a call never blocks where nothing can interrupt
// it: the watchdog's abort (abort(), from another thread) ends the poll, and so does the
// communicator's timeout, each with an error naming the call. While a call is in progress, the
// asynchronous error reads ncclInProgress, which is not a failure.
//
// Note [captured operations]
// An operation enqueued while the caller's stream is being captured into a CUDA graph is recorded,
// not run: it runs at each replay, where no host-side handle sees it. Its event is a captured event,
// which cudaEventQuery refuses with cudaErrorCapturedEvent (during the capture and after it, until
// the event is recorded again outside a capture). So such an operation gets no completion query
// at all (it is complete for the host once enqueued, like PyTorch's ProcessGroupNCCL, which keeps
// captured work away from its watchdog), and a query that meets a captured event all the same
// counts it as complete instead of taking it for a device failure and aborting the communicator.

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace fsdpp::comm::nccl {

// A CUDA or NCCL failure: "rank 1/4 all_gather: NCCL error 'unhandled cuda error' (last: ...)".
class NcclError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An owned CUDA event (timing disabled), shared by the operations and waits that use it. Events
// come from a pool: the last owner returns the event instead of destroying it.
using EventPtr = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;

class EventPool;

// What a completion query of an operation's event found (Note [captured operations]).
enum class Completion { kDone, kInFlight, kFailed };

// Classifies cudaEventQuery's answer for an operation on a communicator that is `aborted` or whose
// asynchronous error is `async_error`: done on success or on a captured event; in flight while not
// ready and nothing failed (ncclInProgress is no failure: Note [non-blocking communicators]);
// failed otherwise (a device error, an abort, an NCCL error).
Completion completion_of(cudaError_t query, bool aborted, ncclResult_t async_error);

// Whether work issued now on `stream` is being captured into a CUDA graph (recorded, not run).
// False where the stream cannot be asked (an error clears itself and counts as not capturing).
bool capturing(cudaStream_t stream);

// How ranks meet: rank 0 publishes the NCCL unique id under a key, the others read it (blocking
// until it is there). The dist layer passes its Store.
struct Rendezvous {
  std::function<void(const std::string& key, const std::vector<uint8_t>& value)> set;
  std::function<std::vector<uint8_t>(const std::string& key)> get;
};

class Core {
 public:
  // Collective over `size` ranks: makes `device` current, creates a non-blocking stream and the
  // communicator (eagerly, ncclCommInitRankConfig with the id rank 0 published under `key`). A
  // call that has not finished after `timeout` fails (Note [non-blocking communicators]).
  Core(int rank, int size, int device, const Rendezvous& rendezvous, const std::string& key,
       std::chrono::milliseconds timeout = std::chrono::minutes(5));
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  // Collective: ranks with the same color form a new communicator (ncclCommSplit), ordered by
  // (key, rank); a negative color takes part and gets null.
  std::unique_ptr<Core> split(int color, int key);

  // Each returns the event that completes with the operation (see Note [stream ordering]).
  // Counts are elements of `type`; all_gather and reduce_scatter count one rank's part.
  EventPtr all_gather(const void* in, void* out, size_t count, ncclDataType_t type, cudaEvent_t ready);
  EventPtr reduce_scatter(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                          cudaEvent_t ready);
  EventPtr all_reduce(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                      cudaEvent_t ready);
  EventPtr broadcast(void* buffer, size_t count, ncclDataType_t type, int root, cudaEvent_t ready);
  // Element counts and offsets per peer, in one NCCL group.
  EventPtr all_to_all(const void* in, void* out, const std::vector<size_t>& send_counts,
                      const std::vector<size_t>& send_offsets, const std::vector<size_t>& recv_counts,
                      const std::vector<size_t>& recv_offsets, ncclDataType_t type, cudaEvent_t ready);
  // Sends and receives in one NCCL group, so that they progress together (Note [point-to-point
  // groups] in fsdpp/comm/comm.hpp).
  struct P2p {
    bool send;
    void* buffer;
    size_t count;
    ncclDataType_t type;
    int peer;
  };
  EventPtr p2p(const std::vector<P2p>& ops, cudaEvent_t ready);
  // An all-reduce of one element on a scratch buffer.
  EventPtr barrier();

  // Size in bytes of one element of `type`.
  static size_t element_size(ncclDataType_t type);

  // An error NCCL hit after an operation was enqueued (a peer gone, a network failure), or
  // ncclSuccess; ncclCommGetAsyncError, safe to call from any thread.
  ncclResult_t async_error() const;
  std::string async_error_message() const;
  // Ends the communicator's operations in flight (ncclCommAbort), so that a rank whose peers are
  // gone or hung can exit; the communicator is unusable afterwards. Idempotent, any thread.
  void abort();
  bool aborted() const { return aborted_.load(); }

 private:
  Core(int rank, int size, int device, ncclComm_t comm, std::chrono::milliseconds timeout);
  void check(cudaError_t e, const char* what) const;
  void check(ncclResult_t r, const char* what) const;
  // check(), after waiting for a call that returned ncclInProgress to finish.
  void settle(ncclResult_t r, const char* what) const;
  void wait_for(cudaEvent_t ready, const char* what);
  EventPtr finished(const char* what);

  int rank_, size_, device_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<EventPool> events_;
  std::atomic<bool> aborted_{false};
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;  // the barrier's element
};

}  // namespace fsdpp::comm::nccl
