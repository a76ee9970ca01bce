#include "fsdpp/base/storage.hpp"

#include "fsdpp/base/spin_lock.hpp"

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>

#include <cstdlib>
#include <atomic>
#include <stdexcept>
#include <mutex>
#include <vector>

namespace fsdpp {

namespace {

void set_bytes(c10::StorageImpl* s, at::DataPtr p, size_t nbytes) {
  s->set_data_ptr_noswap(std::move(p));
  s->set_nbytes(nbytes);
}

int64_t limit_from_env() {
  constexpr int64_t kDefaultMiB = 256;
  const char* v = std::getenv("FSDPP_HOST_BUFFER_CACHE_MB");
  if (!v || !*v) return kDefaultMiB << 20;
  char* end = nullptr;
  const long long mib = std::strtoll(v, &end, 10);
  if (*end != '\0' || mib < 0 || mib > (int64_t{1} << 30))
    throw std::invalid_argument(fmt::format(
        "environment variable FSDPP_HOST_BUFFER_CACHE_MB='{}' is not a whole number of MiB (0 turns "
        "the host buffer cache off)",
        v));
  return static_cast<int64_t>(mib) << 20;
}

// Note [host buffer cache]. One bucket per size, searched linearly (a model's units come in a
// few sizes); a bucket hands out its most recently freed buffer first, the one likeliest to be in
// the caches still. Taking and giving happen under a SpinLock (a unit's step makes about ten of
// them), held for a bucket search and a vector push or pop.
class HostBufferCache {
 public:
  static HostBufferCache& get() {
    // Never destroyed: buffers still cached at exit go with the process, and no static
    // destructor runs after the allocator's.
    static auto* cache = new HostBufferCache();
    return *cache;
  }

  at::DataPtr take(c10::Allocator* allocator, size_t nbytes) {
    {
      std::lock_guard<SpinLock> lock(lock_);
      if (Bucket* b = find(allocator, nbytes); b && !b->free.empty()) {
        at::DataPtr p = std::move(b->free.back());
        b->free.pop_back();
        stats_.cached_bytes -= static_cast<int64_t>(nbytes);
        ++stats_.hits;
        return p;
      }
      ++stats_.misses;
    }
    return allocator->allocate(nbytes);
  }

  void give(c10::Allocator* allocator, at::DataPtr p, size_t nbytes) {
    {
      std::lock_guard<SpinLock> lock(lock_);
      if (stats_.cached_bytes + static_cast<int64_t>(nbytes) <= limit_.load(std::memory_order_relaxed)) {
        Bucket* b = find(allocator, nbytes);
        if (!b) b = &buckets_.emplace_back(Bucket{allocator, nbytes, {}});
        b->free.push_back(std::move(p));
        stats_.cached_bytes += static_cast<int64_t>(nbytes);
        return;
      }
      ++stats_.freed;
    }
    // p frees its buffer on leaving, outside the lock
  }

  HostBufferCacheStats stats() {
    std::lock_guard<SpinLock> lock(lock_);
    HostBufferCacheStats s = stats_;
    s.limit_bytes = limit_.load(std::memory_order_relaxed);
    return s;
  }

  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }

  void set_limit(int64_t bytes) {
    if (bytes < 0) throw std::invalid_argument(fmt::format("host buffer cache limit {} is negative", bytes));
    std::vector<at::DataPtr> dropped;  // freed outside the lock
    std::lock_guard<SpinLock> lock(lock_);
    limit_.store(bytes, std::memory_order_relaxed);
    for (auto& b : buckets_)
      while (stats_.cached_bytes > bytes && !b.free.empty()) {
        dropped.push_back(std::move(b.free.back()));
        b.free.pop_back();
        stats_.cached_bytes -= static_cast<int64_t>(b.nbytes);
      }
  }

 private:
  HostBufferCache() : limit_(limit_from_env()) {}

  // The free buffers of one size, most recently freed last.
  struct Bucket {
    c10::Allocator* allocator;
    size_t nbytes;
    std::vector<at::DataPtr> free;
  };
  Bucket* find(c10::Allocator* allocator, size_t nbytes) {
    for (auto& b : buckets_)
      if (b.nbytes == nbytes && b.allocator == allocator) return &b;
    return nullptr;
  }
  SpinLock lock_;
  std::atomic<int64_t> limit_;   // read without the lock by host_buffer_cache_limit()
  std::vector<Bucket> buckets_;  // a model's units come in a few sizes
  HostBufferCacheStats stats_;   // limit_bytes filled in by stats()
};

}  // namespace

void resize_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes) return;
  set_bytes(s, nbytes ? s->allocator()->allocate(nbytes) : at::DataPtr(nullptr, s->device()), nbytes);
}

at::Tensor unallocated_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  auto t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

bool is_unallocated(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 && t.has_storage() && t.storage().nbytes() == 0;
}

void* resize_storage_bytes_cached(const at::Tensor& t, size_t nbytes) {
  // A plain strided tensor's storage, read without the virtual call of storage().
  c10::StorageImpl* s = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (!s) s = t.storage().unsafeGetStorageImpl();  // not a plain tensor: storage() says why
  const size_t had = s->nbytes();
  if (had != nbytes) {
    if (!s->device().is_cpu()) {
      resize_storage_bytes(t, nbytes);
    } else {
      auto& cache = HostBufferCache::get();
      // Callers go between empty and full size; a storage resized from one size to another gives
      // its old buffer to the cache first.
      at::DataPtr old = s->set_data_ptr(at::DataPtr(nullptr, s->device()));
      if (had > 0 && old.get() != nullptr) cache.give(s->allocator(), std::move(old), had);
      if (nbytes > 0)
        set_bytes(s, cache.take(s->allocator(), nbytes), nbytes);
      else
        s->set_nbytes(0);
    }
  }
  return s->mutable_data();
}

HostBufferCacheStats host_buffer_cache_stats() { return HostBufferCache::get().stats(); }

int64_t host_buffer_cache_limit() { return HostBufferCache::get().limit(); }

void set_host_buffer_cache_limit(int64_t bytes) { HostBufferCache::get().set_limit(bytes); }

}  // namespace fsdpp
