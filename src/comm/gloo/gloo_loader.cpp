// Opens the Gloo backend's plugin on first use.
//
// Note [Gloo in its own lookup scope]
// LibTorch carries a Gloo of its own inside libtorch_cpu.so: its symbols are exported, but its
// headers are not shipped (PyTorch's own ProcessGroupGloo.hpp includes <gloo/algorithm.h>, which
// the wheel lacks), so nothing outside LibTorch can call it safely. fsdpp's backend is built on
// Debian's libgloo instead. The two define the same C++ symbols with different layouts (Debian's is
// from 2022), and the dynamic linker binds every call to the first definition it finds in the global
// scope: a process that loaded both the usual way would send one library's calls into the other.
// So the backend lives in a plugin, libfsdpp_gloo.so, opened with RTLD_LOCAL | RTLD_DEEPBIND:
//  - its calls, and libgloo's own, are looked up in the plugin's dependencies first, where Debian's
//    libgloo is listed before LibTorch (CMakeLists.txt links it first);
//  - Debian's libgloo never enters the global scope, so LibTorch's calls still bind to its own copy.
// Nothing else in the process links libgloo. tests/comm/test_libraries.cpp checks both bindings.
#include <dlfcn.h>
#include <fmt/format.h>

#include <mutex>
#include <string>

#include "../backend.hpp"

#if FSDPP_WITH_GLOO
#include "gloo_plugin.hpp"
#endif

namespace fsdpp::comm::detail {

#if FSDPP_WITH_GLOO

namespace {

struct Loaded {
  const GlooPlugin* plugin = nullptr;
  std::string error;
};

// The plugin sits beside libfsdpp.so, in the build tree and where both are installed.
std::string plugin_path() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&plugin_path), &info) || !info.dli_fname) return FSDPP_GLOO_PLUGIN;
  std::string self = info.dli_fname;
  const auto slash = self.rfind('/');
  return slash == std::string::npos ? FSDPP_GLOO_PLUGIN : self.substr(0, slash + 1) + FSDPP_GLOO_PLUGIN;
}

const Loaded& load() {
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string path = plugin_path();
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!handle) {
      loaded.error = fmt::format("opening the Gloo backend's plugin failed: {}", dlerror());
      return;
    }
    auto entry = reinterpret_cast<decltype(&fsdpp_gloo_plugin)>(dlsym(handle, "fsdpp_gloo_plugin"));
    if (!entry) {
      loaded.error = fmt::format("{} has no entry point fsdpp_gloo_plugin", path);
      return;
    }
    loaded.plugin = entry();  // the handle stays open for the life of the process
  });
  return loaded;
}

}  // namespace

bool gloo_available() { return load().plugin != nullptr; }

std::string gloo_library() {
  const auto& l = load();
  if (!l.plugin) throw CommError(l.error);
  return l.plugin->gloo_library();
}

std::shared_ptr<CommImpl> make_gloo_comm(std::shared_ptr<Store> store, int rank, int size,
                                         const BackendConfig& config) {
  const auto& l = load();
  if (!l.plugin) throw CommError(fmt::format("rank {}/{}: {}", rank, size, l.error));
  return l.plugin->make_comm(std::move(store), rank, size, config);
}

#else

bool gloo_available() { return false; }

std::string gloo_library() { return ""; }

std::shared_ptr<CommImpl> make_gloo_comm(std::shared_ptr<Store>, int rank, int size, const BackendConfig&) {
  throw CommError(
      fmt::format("rank {}/{}: the Gloo backend was requested, but this fsdpp was built "
                  "without Gloo (install libgloo-dev and configure with -DFSDPP_WITH_GLOO=ON)",
                  rank, size));
}

#endif

}  // namespace fsdpp::comm::detail
