#pragma once
// Creating communicators: from torchrun-style environment variables (env://) or from a store the
// caller made. Communicators connect eagerly, so a wrong address, port or world size fails here,
// within the timeout, and not at the first collective.

#include <chrono>
#include <memory>
#include <string>

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/comm/store.hpp"
#include "fsdpp/comm/types.hpp"

namespace fsdpp::comm {

// The launch environment, as torchrun and `fsdpp launch` set it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  uint16_t master_port = 0;
  bool agent_hosts_store = false;  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher runs the store
};

// Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (required) and LOCAL_RANK, LOCAL_WORLD_SIZE
// (optional). Throws CommError naming the variable that is missing or malformed.
LaunchEnv read_launch_env();

// True when the variables of a launcher (ours or torchrun) are present.
bool launched_by_launcher();

enum class Backend { kGloo, kNccl };

struct InitOptions {
  Backend backend = Backend::kGloo;
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Address this rank's transport listens on. Empty: 127.0.0.1 when the store is on loopback,
  // otherwise the local address that routes to the store's host. FSDPP_BIND_ADDR overrides.
  std::string bind_address;
  // The watchdog (fsdpp/comm/flight_recorder.hpp): an operation in flight longer than this makes every
  // rank dump its flight records to `flight_record_dir`, and ends the processes. Zero: off. The
  // environment changes neither unless the program asks (with_watchdog_from_env).
  std::chrono::milliseconds watchdog_timeout{0};
  std::string flight_record_dir = "fsdpp-flight-records";
  // Gloo only: run operations under NCCL's ordering rules (one queue per communicator, a send
  // completes only once its receive has started, groups through Comm::batch_p2p), and fail an
  // operation that would hang on NCCL, naming every rank's operation in the cycle. A check for
  // tests (slower than plain Gloo); FSDPP_CHECK_NCCL_ORDER=1 turns it on too.
  bool check_nccl_order = false;
};

// The world communicator of a launched process (env://).
Comm init_from_env(const InitOptions& options = {});

// `options` with the watchdog's settings from the environment, for a program that lets its users
// set them there (the fsdpp CLI, the test programs): FSDPP_WATCHDOG_TIMEOUT_S (seconds; 0: off)
// over watchdog_timeout, FSDPP_FR_DUMP_DIR over flight_record_dir. A program that does not call it
// gets no watchdog from its environment. Throws CommError naming a malformed value.
InitOptions with_watchdog_from_env(InitOptions options);

// A communicator of `size` ranks that rendezvous through `store`. Every rank passes a store that
// sees the same keys (for example the same file, or the same TCP store).
Comm connect(std::shared_ptr<Store> store, int rank, int size, const InitOptions& options = {});

// Whether this build has each backend (FSDPP_WITH_GLOO / FSDPP_WITH_NCCL), whatever devices this
// machine has.
bool has_backend(Backend backend);

// How many CUDA devices this process sees; where none, `why` says why ("no CUDA device is visible",
// the CUDA runtime's error, or a build without CUDA).
int cuda_device_count(std::string* why = nullptr);
// Bytes of memory on CUDA device `device` (0 where there is none).
double cuda_device_memory(int device);

}  // namespace fsdpp::comm
