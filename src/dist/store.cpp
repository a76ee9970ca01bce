// Stores over LibTorch's c10d::TCPStore and c10d::FileStore.
#include "dist/store.hpp"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace fsdpp::dist {

namespace {

class C10dStore : public Store {
 public:
  C10dStore(c10::intrusive_ptr<c10d::Store> store, std::string where)
      : store_(std::move(store)), where_(std::move(where)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    store_->set(key, value);
  }
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
  int64_t add(const std::string& key, int64_t delta) override {
    return base_->add(prefix_ + key, delta);
  }
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

}  // namespace

std::shared_ptr<Store> make_tcp_store(const TcpStoreOptions& options) {
  c10d::TCPStoreOptions o;
  o.port = options.port;
  o.isServer = options.is_server;
  o.waitWorkers = false;  // joining is checked by the rendezvous, with a better message
  o.timeout = options.timeout;
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(options.host, o);
  } catch (const std::exception& e) {
    if (options.is_server)
      throw CommError(fmt::format("cannot host the rendezvous store on port {}: {}", options.port,
                                  e.what()));
    throw CommError(fmt::format("cannot reach the rendezvous store at {}:{} within {} s: {}",
                                options.host, options.port, options.timeout.count() / 1000.0,
                                e.what()));
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

}  // namespace fsdpp::dist
