#pragma once
// Internal: the entry point of the Gloo backend's plugin (libfsdpp_gloo.so), which libfsdpp opens in
// a lookup scope of its own (Note [Gloo in its own lookup scope], gloo_loader.cpp).
#include <memory>

#include "../backend.hpp"

namespace fsdpp::comm::detail {

struct GlooPlugin {
  std::shared_ptr<CommImpl> (*make_comm)(std::shared_ptr<Store> store, int rank, int size,
                                         const BackendConfig& config);
  // The file that defines the Gloo functions the backend calls, as the dynamic linker bound them.
  const char* (*gloo_library)();
};

}  // namespace fsdpp::comm::detail

// Exported by the plugin with C linkage, so that dlsym finds it by this name.
extern "C" const fsdpp::comm::detail::GlooPlugin* fsdpp_gloo_plugin();
