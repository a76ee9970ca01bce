#pragma once
// Storage resizing shared by fully_shard (unsharded parameters and communication buffers that
// exist only while used) and the pipeline executor (forward outputs dropped after their send).

#include <ATen/core/Tensor.h>

#include <cstddef>

namespace fsdpp {

// Gives `t`'s storage `nbytes` bytes from the storage's own allocator (the caching allocator for
// CUDA tensors), or frees it for 0. Every tensor viewing the storage sees the change; contents are
// not kept, so callers go from empty to full size (and write it whole) or from full size to empty.
void resize_storage_bytes(const at::Tensor& t, size_t nbytes);

}  // namespace fsdpp
