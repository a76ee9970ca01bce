// Linked when fsdpp is built without Gloo (FSDPP_WITH_GLOO=OFF).
#include "../backend.hpp"

namespace fsdpp::dist::detail {

bool gloo_available() { return false; }

std::shared_ptr<CommImpl> make_gloo_comm(std::shared_ptr<Store>, int rank, int size,
                                         const BackendConfig&) {
  throw CommError("rank " + std::to_string(rank) + "/" + std::to_string(size) +
                  ": the Gloo backend was requested, but this fsdpp was built without Gloo "
                  "(install libgloo-dev and configure with -DFSDPP_WITH_GLOO=ON)");
}

}  // namespace fsdpp::dist::detail
