// Rendezvous: reading the launch environment, the join check, and choosing a backend.
#include "fsdpp/comm/init.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <random>
#include <thread>

#include "backend.hpp"
#include "fsdpp/comm/flight_recorder.hpp"

namespace fsdpp::comm {

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

int env_int(const char* name, int lo, int hi, std::optional<int> fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    if (fallback) return *fallback;
    throw CommError(
        fmt::format("environment variable {} is not set; start the program with `fsdpp launch` or torchrun, "
                    "or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE",
                    name));
  }
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi)
    throw CommError(
        fmt::format("environment variable {}='{}' is not an integer in [{}, {}]", name, v, lo, hi));
  return static_cast<int>(x);
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr a4{};
  if (inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  if (inet_pton(AF_INET6, host.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  return false;
}

// The local address the kernel would use to reach `host`: a UDP "connect" sends nothing, it only
// picks a route.
std::string local_address_towards(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port ? port : 9).c_str(), &hints, &res) != 0 || !res)
    throw CommError(fmt::format("cannot resolve MASTER_ADDR '{}'", host));
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  std::string out;
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN];
      if (inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf))) out = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  if (out.empty())
    throw CommError(
        fmt::format("no network route to MASTER_ADDR '{}'; set FSDPP_BIND_ADDR to this "
                    "host's address",
                    host));
  return out;
}

std::string process_token(int size) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::random_device rd;
  return fmt::format("size={} host={} pid={} id={:x}", size, host, getpid(), (uint64_t{rd()} << 32) | rd());
}

int token_size(const std::string& token) { return std::atoi(token.c_str() + token.find('=') + 1); }

std::string describe_token(const std::string& token) {
  return token.substr(token.find(' ') + 1, token.rfind(" id=") - token.find(' ') - 1);
}

detail::BackendConfig backend_config(const InitOptions& options, const std::string& store_host) {
  detail::BackendConfig config;
  config.timeout = options.timeout;
  config.bind_address = env_or("FSDPP_BIND_ADDR", options.bind_address);
  if (config.bind_address.empty())
    config.bind_address =
        store_host.empty() || is_loopback(store_host) ? "127.0.0.1" : local_address_towards(store_host, 0);
  return config;
}

// The backend's communicator over `store` (already joined), under the NCCL-order check when asked.
std::shared_ptr<detail::CommImpl> make_backend(const std::shared_ptr<Store>& store, int rank, int size,
                                               const InitOptions& options,
                                               const detail::BackendConfig& config) {
  if (options.backend == Backend::kNccl) return detail::make_nccl_comm(store, rank, size, config);
  auto comm = detail::make_gloo_comm(store, rank, size, config);
  if (options.check_nccl_order || env_or("FSDPP_CHECK_NCCL_ORDER", "") == "1")
    comm = detail::make_nccl_order_comm(std::move(comm), store, options.timeout);
  return comm;
}

}  // namespace

namespace detail {

void join(Store& store, int rank, int size, std::chrono::milliseconds timeout) {
  const std::string token = process_token(size);
  const auto key = [](int r) { return "joined/" + std::to_string(r); };
  store.set(key(rank), std::vector<uint8_t>(token.begin(), token.end()));

  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  // Poll rather than block in the store's wait, so that a timeout can say who is missing.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  auto next_note = start + std::chrono::seconds(10);
  auto pause = std::chrono::milliseconds(1);
  while (!store.check(keys)) {
    if (const auto now = std::chrono::steady_clock::now(); now >= next_note && rank == 0) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r)
        if (!store.check({key(r)})) missing.push_back(r);
      std::cerr << fmt::format("fsdpp: rank 0 of {}: waiting for rank(s) {} to join ({:.0f} s of {:.0f} s)\n",
                               size, fmt::join(missing, ", "),
                               std::chrono::duration<double>(now - start).count(), timeout.count() / 1000.0)
                << std::flush;
      next_note += std::chrono::seconds(10);
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r)
        if (!store.check({key(r)})) missing.push_back(r);
      throw CommError(
          fmt::format("rank {} of {}: rendezvous through {} timed out after {:.1f} s: {} of {} ranks joined, "
                      "missing rank(s) {}. Check that every rank was started with WORLD_SIZE={} and the same "
                      "MASTER_ADDR and MASTER_PORT",
                      rank, size, store.where(), timeout.count() / 1000.0, size - missing.size(), size,
                      fmt::join(missing, ", "), size));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  for (int r = 0; r < size; ++r) {
    const auto v = store.get(key(r));
    const std::string other(v.begin(), v.end());
    if (r == rank && other != token)
      throw CommError(fmt::format("rank {} of {}: two processes claim rank {}: this one ({}) and {}", rank,
                                  size, rank, describe_token(token), describe_token(other)));
    if (token_size(other) != size)
      throw CommError(
          fmt::format("rank {} of {}: rank {} ({}) was started with WORLD_SIZE={}, "
                      "this rank with WORLD_SIZE={}",
                      rank, size, r, describe_token(other), token_size(other), size));
  }
}

}  // namespace detail

bool launched_by_launcher() {
  return std::getenv("RANK") && std::getenv("WORLD_SIZE") && std::getenv("MASTER_ADDR");
}

LaunchEnv read_launch_env() {
  LaunchEnv env;
  env.world_size = env_int("WORLD_SIZE", 1, 1 << 20, std::nullopt);
  env.rank = env_int("RANK", 0, env.world_size - 1, std::nullopt);
  env.local_world_size = env_int("LOCAL_WORLD_SIZE", 1, env.world_size, env.world_size);
  env.local_rank = env_int("LOCAL_RANK", 0, env.local_world_size - 1, env.rank % env.local_world_size);
  env.master_addr = env_or("MASTER_ADDR", "");
  if (env.master_addr.empty()) (void)env_int("MASTER_ADDR", 0, 0, std::nullopt);  // throws
  env.master_port = static_cast<uint16_t>(env_int("MASTER_PORT", 1, 65535, std::nullopt));
  env.agent_hosts_store = env_or("TORCHELASTIC_USE_AGENT_STORE", "") == "True";
  return env;
}

Comm init_from_env(const InitOptions& options) {
  const LaunchEnv env = read_launch_env();
  // A name that cannot resolve fails at once, naming the variable (not after the timeout's retries).
  {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (const int rc = getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &res); rc != 0)
      throw CommError(fmt::format("rank {} of {}: MASTER_ADDR='{}' does not resolve: {}", env.rank,
                                  env.world_size, env.master_addr, gai_strerror(rc)));
    freeaddrinfo(res);
  }
  TcpStoreOptions so;
  so.host = env.master_addr;
  so.port = env.master_port;
  so.is_server = env.rank == 0 && !env.agent_hosts_store;
  so.timeout = options.timeout;
  std::shared_ptr<Store> store;
  try {
    store = make_tcp_store(so);
  } catch (const CommError& e) {
    throw CommError(fmt::format("rank {} of {}: {}", env.rank, env.world_size, e.what()));
  }
  auto config = backend_config(options, env.master_addr);
  config.device = env.local_rank;  // one GPU per local rank, as under torchrun
  // Each start of the group (TORCHELASTIC_RESTART_COUNT, under fsdpp launch or torchrun with
  // restarts) rendezvous under its own keys: the store outlives a failed start, and its keys.
  const std::string attempt = env_or("TORCHELASTIC_RESTART_COUNT", "0");
  const std::string prefix = attempt == "0" ? "fsdpp" : "fsdpp/restart" + attempt;
  auto world = make_prefix_store(prefix + "/world", store);
  detail::join(*world, env.rank, env.world_size, options.timeout);
  Comm comm(make_backend(world, env.rank, env.world_size, options, config), "world");
  if (options.watchdog_timeout.count() > 0) {  // the program asked (Note on InitOptions)
    WatchdogOptions w;
    w.timeout = options.watchdog_timeout;
    w.dump_dir = options.flight_record_dir;
    w.exit_code = kWatchdogExitCode;
    w.rank = env.rank;
    // A connection of its own: the watchdog polls the store from its thread.
    TcpStoreOptions wo = so;
    wo.is_server = false;
    w.store = make_prefix_store(prefix + "/fr", make_tcp_store(wo));
    if (so.is_server) w.hosted = store;
    w.world_size = env.world_size;
    start_watchdog(w);
  }
  return comm;
}

InitOptions with_watchdog_from_env(InitOptions options) {
  if (const char* t = std::getenv("FSDPP_WATCHDOG_TIMEOUT_S"); t && *t) {
    char* end = nullptr;
    const double s = std::strtod(t, &end);
    if (*end != '\0' || !(s >= 0) || s > 1e7)
      throw CommError(fmt::format("FSDPP_WATCHDOG_TIMEOUT_S='{}' is not a number of seconds in [0, 1e7]", t));
    options.watchdog_timeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  }
  options.flight_record_dir = env_or("FSDPP_FR_DUMP_DIR", options.flight_record_dir);
  return options;
}

Comm connect(std::shared_ptr<Store> store, int rank, int size, const InitOptions& options) {
  if (size < 1 || rank < 0 || rank >= size)
    throw CommError(fmt::format("connect: rank {} is outside [0, {})", rank, size));
  const auto config = backend_config(options, "");
  detail::join(*store, rank, size, options.timeout);
  return Comm(make_backend(store, rank, size, options, config), "world");
}

bool has_backend(Backend backend) {
  return backend == Backend::kNccl ? detail::nccl_available() : detail::gloo_available();
}

int cuda_device_count(std::string* why) { return detail::cuda_device_count(why); }
double cuda_device_memory(int device) { return detail::cuda_device_memory(device); }

}  // namespace fsdpp::comm
