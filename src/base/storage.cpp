#include "fsdpp/base/storage.hpp"

#include <c10/core/StorageImpl.h>

namespace fsdpp {

void resize_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes) return;
  s->set_data_ptr_noswap(nbytes ? s->allocator()->allocate(nbytes) : at::DataPtr(nullptr, s->device()));
  s->set_nbytes(nbytes);
}

}  // namespace fsdpp
