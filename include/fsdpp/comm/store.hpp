#pragma once
// Store: the key-value service ranks rendezvous through. Backed by LibTorch's c10d::TCPStore
// (env://, the way torchrun works) or c10d::FileStore (tests and shared file systems).

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdpp/comm/types.hpp"

namespace fsdpp::comm {

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists or the store's timeout passes.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key exists; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Blocks until every key exists; throws CommError after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Where the store lives, for error messages ("127.0.0.1:29500", "file /tmp/x").
  virtual std::string where() const = 0;
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 with is_server: pick a free port (see Store::where)
  bool is_server = false;
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

// Connects to (or, with is_server, hosts) a c10d::TCPStore. A client that cannot reach the server
// within the timeout gets a CommError naming the address.
std::shared_ptr<Store> make_tcp_store(const TcpStoreOptions& options);

// The port a TCP store listens on (useful after asking for port 0).
uint16_t tcp_store_port(const Store& store);

std::shared_ptr<Store> make_file_store(const std::string& path, int world_size,
                                       std::chrono::milliseconds timeout = kDefaultTimeout);

// Keys seen through this view are prefixed with "<prefix>/".
std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> base);

}  // namespace fsdpp::comm
