#pragma once
// Internal: what init.cpp needs from the backends and the shared rendezvous step.
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/comm/store.hpp"

namespace fsdpp::comm::detail {

struct BackendConfig {
  std::string bind_address = "127.0.0.1";
  std::chrono::milliseconds timeout = kDefaultTimeout;
  int device = -1;  // NCCL: the CUDA device (LOCAL_RANK under a launcher); -1: the current one
};

// Every rank announces itself under `store` and waits for the others. Fails with a CommError that
// names the missing ranks, a world size that differs between ranks, or a rank claimed twice.
void join(Store& store, int rank, int size, std::chrono::milliseconds timeout);

// `store` is private to the new communicator (already prefixed); join() has run on it.
std::shared_ptr<CommImpl> make_gloo_comm(std::shared_ptr<Store> store, int rank, int size,
                                         const BackendConfig& config);
std::shared_ptr<CommImpl> make_nccl_comm(std::shared_ptr<Store> store, int rank, int size,
                                         const BackendConfig& config);
bool gloo_available();
// The NCCL-order check over a Gloo communicator (Note [NCCL order on the CPU] in nccl_order.cpp);
// `store` is the communicator's own. Returns `inner` itself at one rank.
std::shared_ptr<CommImpl> make_nccl_order_comm(std::shared_ptr<CommImpl> inner, std::shared_ptr<Store> store,
                                               std::chrono::milliseconds timeout);
// The file that defines the Gloo functions fsdpp's backend calls ("" without Gloo); throws a
// CommError when the backend's plugin cannot be opened.
std::string gloo_library();

// Hooks the watchdog runs before it ends the process: backends whose operations can hang on a
// device (NCCL) abort their communicators there, so that the process can exit and report.
void add_abort_hook(std::function<void()> hook);
void run_abort_hooks();

// Records a failed operation for the launcher (see Note [collateral failures]).
void note_failure(const std::string& what, std::exception_ptr error);
bool is_peer_loss(const std::string& message);
// Whether this build has the NCCL backend (whatever devices the machine has).
bool nccl_available();
// CUDA devices visible to this process; 0 with `why` set where there are none or no CUDA.
int cuda_device_count(std::string* why);
double cuda_device_memory(int device);

}  // namespace fsdpp::comm::detail
