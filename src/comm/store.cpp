// Stores over LibTorch's c10d::TCPStore and c10d::FileStore.
#include "fsdpp/comm/store.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>

namespace fsdpp::comm {

namespace {

class C10dStore : public Store {
 public:
  C10dStore(c10::intrusive_ptr<c10d::Store> store, std::string where)
      : store_(std::move(store)), where_(std::move(where)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override { store_->set(key, value); }
  std::vector<uint8_t> get(const std::string& key) override { return store_->get(key); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    try {
      store_->wait(keys, timeout);
    } catch (const std::exception& e) {
      throw CommError(fmt::format("waiting for {} key(s) in the store at {} timed out after {} ms",
                                  keys.size(), where_, timeout.count()));
    }
  }
  std::string where() const override { return where_; }

  c10d::Store& c10d() const { return *store_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string where_;
};

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base)
      : prefix_(std::move(prefix) + "/"), base_(std::move(base)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    base_->set(prefix_ + key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override { return base_->get(prefix_ + key); }
  int64_t add(const std::string& key, int64_t delta) override { return base_->add(prefix_ + key, delta); }
  bool check(const std::vector<std::string>& keys) override { return base_->check(prefixed(keys)); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    base_->wait(prefixed(keys), timeout);
  }
  std::string where() const override { return base_->where(); }

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(prefix_ + k);
    return out;
  }

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

// Note [store bind address]
// c10d::TCPStore's server listens on every interface. Given a numeric address to host on (the
// launcher's 127.0.0.1 for a single-node run, or node 0's own address), fsdpp binds the listening
// socket to that address itself and hands it to the store (masterListenFd): a single-node run's
// store is then reachable from this machine only, and a multi-node one only through the address
// the job names. A host name keeps c10d's own socket (every interface).

// A listening socket bound to `host:port` when `host` is a numeric IPv4 or IPv6 address; nullopt
// for a host name. Throws CommError when the address cannot be bound.
std::optional<int> listen_on(const std::string& host, uint16_t port) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    len = sizeof(sockaddr_in6);
  } else {
    return std::nullopt;
  }
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    throw CommError(fmt::format("cannot host the rendezvous store: socket: {}", std::strerror(errno)));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    close(fd);
    throw CommError(
        fmt::format("cannot host the rendezvous store on {}:{}: {}", host, port, std::strerror(e)));
  }
  return fd;
}

// The addresses of `host`, or a CommError naming the host and the resolver's reason.
addrinfo* resolve_host(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0 || !res)
    throw CommError(fmt::format("cannot resolve the rendezvous host '{}': {}", host, gai_strerror(rc)));
  return res;
}

// Waits until something listens at host:port (a connect succeeds), saying every 10 s what it waits
// for, so that a rank whose store is not up yet is not silent (nor LibTorch's retries loud).
void wait_for_listener(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  auto next_note = start + std::chrono::seconds(10);
  for (;;) {
    addrinfo* res = resolve_host(host, port);
    bool up = false;
    for (addrinfo* a = res; a && !up; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      up = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      ::close(fd);
    }
    freeaddrinfo(res);
    if (up) return;
    const auto now = std::chrono::steady_clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    if (now - start >= timeout)
      throw CommError(
          fmt::format("cannot reach the rendezvous store at {}:{} within {:.1f} s: nothing listens there "
                      "(is rank 0, or the launcher of node 0, started with the same MASTER_ADDR and "
                      "MASTER_PORT?)",
                      host, port, waited));
    if (now >= next_note) {
      std::cerr << fmt::format("fsdpp: waiting for the rendezvous store at {}:{} ({:.0f} s of {:.0f} s)\n",
                               host, port, waited, timeout.count() / 1000.0)
                << std::flush;
      next_note += std::chrono::seconds(10);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

uint16_t bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&addr)->sin_port
                                         : reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
}

}  // namespace

std::shared_ptr<Store> make_tcp_store(const TcpStoreOptions& options) {
  c10d::TCPStoreOptions o;
  o.port = options.port;
  o.isServer = options.is_server;
  if (options.is_server)
    if (const auto fd = listen_on(options.host, options.port)) {  // Note [store bind address]
      o.masterListenFd = *fd;
      o.port = bound_port(*fd);
    }
  o.waitWorkers = false;  // joining is checked by the rendezvous, with a better message
  o.timeout = options.timeout;
  if (!options.is_server) {
    freeaddrinfo(resolve_host(options.host, options.port));  // a name that never resolves fails now
    wait_for_listener(options.host, options.port, options.timeout);
  }
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(options.host, o);
  } catch (const std::exception& e) {
    if (options.is_server)
      throw CommError(fmt::format("cannot host the rendezvous store on port {}: {}", options.port, e.what()));
    throw CommError(fmt::format("cannot reach the rendezvous store at {}:{} within {} s: {}", options.host,
                                options.port, options.timeout.count() / 1000.0, e.what()));
  }
  const auto port = store->getPort();
  return std::make_shared<C10dStore>(std::move(store), fmt::format("{}:{}", options.host, port));
}

uint16_t tcp_store_port(const Store& store) {
  const auto* s = dynamic_cast<const C10dStore*>(&store);
  const auto* tcp = s ? dynamic_cast<const c10d::TCPStore*>(&s->c10d()) : nullptr;
  if (!tcp) throw CommError("tcp_store_port: " + store.where() + " is not a TCP store");
  return const_cast<c10d::TCPStore*>(tcp)->getPort();
}

std::shared_ptr<Store> make_file_store(const std::string& path, int world_size,
                                       std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  store->setTimeout(timeout);
  return std::make_shared<C10dStore>(std::move(store), "file " + path);
}

std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> base) {
  return std::make_shared<PrefixStore>(std::move(prefix), std::move(base));
}

}  // namespace fsdpp::comm
