// Linked when fsdpp is built without NCCL (FSDPP_WITH_NCCL=OFF): the API exists, and asking for
// the backend says why it cannot be had.
#include "../backend.hpp"

namespace fsdpp::comm::detail {

bool nccl_available() { return false; }

double cuda_device_memory(int) { return 0; }

int cuda_device_count(std::string* why) {
  if (why) *why = "this fsdpp was built without CUDA";
  return 0;
}

std::shared_ptr<CommImpl> make_nccl_comm(std::shared_ptr<Store>, int rank, int size, const BackendConfig&) {
  throw CommError("rank " + std::to_string(rank) + "/" + std::to_string(size) +
                  ": the NCCL backend was requested, but this fsdpp was built without NCCL "
                  "(configure with a CUDA-enabled LibTorch and -DFSDPP_WITH_NCCL=ON)");
}

}  // namespace fsdpp::comm::detail
