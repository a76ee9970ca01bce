#pragma once
// Storage resizing shared by fully_shard (unsharded parameters and communication buffers that
// exist only while used) and the pipeline executor (forward outputs dropped after their send).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace fsdpp {

// Gives `t`'s storage `nbytes` bytes from the storage's own allocator (the caching allocator for
// CUDA tensors), or frees it for 0. Every tensor viewing the storage sees the change; contents are
// not kept, so callers go from empty to full size (and write it whole) or from full size to empty.
void resize_storage_bytes(const at::Tensor& t, size_t nbytes);

// Note [unallocated parameters]
// A tensor with a shape, a dtype and a device but no bytes: what a model built to be loaded by rows
// holds before sharding (models::Weights::kUnallocated), as PyTorch builds such a model on the
// meta device. LibTorch's modules cannot move a parameter to the meta device in place (set_data
// refuses the change of backend), so fsdpp frees the parameter's bytes instead. fully_shard reads
// no rows of such a parameter: its shard starts as zeros, to be loaded (train/model_files.hpp's
// load_shards). Reading one otherwise is an error of the caller's, as for a resharded parameter.
// A contiguous tensor of `sizes` on `options`' device whose storage holds no bytes.
at::Tensor unallocated_tensor(at::IntArrayRef sizes, const at::TensorOptions& options);
// Whether `t` has elements but its storage no bytes.
bool is_unallocated(const at::Tensor& t);

// Note [host buffer cache]
// fully_shard frees a unit's unsharded parameters and communication buffers on resharding and
// allocates them again on the next unshard: with many small units, on the CPU, that is several
// aligned mallocs and frees per unit per step, each colder in the cache than the buffer just freed.
// The host buffer cache keeps such freed buffers, by size, and hands the most recently freed one of
// the size asked for to the next unshard: the units of a model are mostly of a few sizes, so the
// buffer one unit releases is the one the next unit takes, and the memory in use at any moment
// stays what it was, plus at most `limit` bytes of buffers waiting for their size to come back.
// CUDA storages are left to PyTorch's caching allocator.
//
// The limit defaults to 256 MiB, or FSDPP_HOST_BUFFER_CACHE_MB; 0 turns the cache off (every
// release frees). A buffer that would take the cache past the limit is freed.
struct HostBufferCacheStats {
  int64_t hits = 0;          // allocations served from the cache
  int64_t misses = 0;        // allocations that went to the allocator
  int64_t freed = 0;         // releases freed because the cache was full (or off)
  int64_t cached_bytes = 0;  // held now
  int64_t limit_bytes = 0;
};
HostBufferCacheStats host_buffer_cache_stats();
// The limit alone, read without taking the cache's lock.
int64_t host_buffer_cache_limit();
// Sets the limit, freeing cached buffers beyond it (0: frees them all and stops caching).
void set_host_buffer_cache_limit(int64_t bytes);

// resize_storage_bytes through the host buffer cache: a CPU storage takes its bytes from the
// cache when it has a buffer of that size, and gives them to it when resized to 0. Returns the
// start of the storage's bytes (null when empty).
void* resize_storage_bytes_cached(const at::Tensor& t, size_t nbytes);

}  // namespace fsdpp
