// One copy of each library where it matters (Gloo and fmt), and SentencePiece kept to itself.
//
// LibTorch carries its own Gloo (exported from libtorch_cpu.so) and its own fmt. fsdpp uses LibTorch's
// fmt, header-only, and keeps its Gloo backend (Debian's libgloo) in a plugin opened in a lookup
// scope of its own (Note [Gloo in its own lookup scope], src/comm/gloo/gloo_loader.cpp). These tests
// read what the dynamic linker really loaded and bound in a process with Gloo communicators open.
#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <link.h>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <filesystem>

#include "../../src/comm/backend.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "comm/ranks.hpp"

using namespace fsdpp;

namespace {

std::vector<std::string> loaded_objects() {
  std::vector<std::string> names;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (info->dlpi_name && *info->dlpi_name)
          static_cast<std::vector<std::string>*>(out)->push_back(info->dlpi_name);
        return 0;
      },
      &names);
  return names;
}

std::string base_name(const std::string& path) { return std::filesystem::path(path).filename(); }

int count_named(const std::vector<std::string>& objects, const std::string& prefix) {
  return static_cast<int>(std::count_if(objects.begin(), objects.end(), [&](const std::string& o) {
    return base_name(o).rfind(prefix, 0) == 0;
  }));
}

// gloo::allreduce(gloo::AllreduceOptions const&), in both copies of Gloo.
constexpr const char* kGlooAllreduce = "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE";

}  // namespace

TEST_CASE("Gloo: fsdpp's calls bind to Debian's libgloo, LibTorch's to its own, and no third copy") {
  REQUIRE(comm::has_backend(comm::Backend::kGloo));
  test::run_ranks(2, [](comm::Comm& comm) {
    auto t = at::full({3}, double(comm.rank() + 1));
    comm.all_reduce(t).wait();
    CHECK(at::equal(t, at::full({3}, 3.0)));
  });
  const auto objects = loaded_objects();
  INFO(fmt::format("{}", fmt::join(objects, "\n")));
  // The plugin and the one libgloo it links.
  CHECK(count_named(objects, "libfsdpp_gloo") == 1);
  CHECK(count_named(objects, "libgloo") == 1);
  const std::string ours = comm::detail::gloo_library();
  INFO("fsdpp's Gloo calls bind to " << ours);
  CHECK(base_name(ours).rfind("libgloo.so", 0) == 0);
  // The global scope (this program, libfsdpp, LibTorch) still resolves Gloo to LibTorch's copy:
  // Debian's libgloo did not enter it, so LibTorch's own calls are not redirected.
  void* global = dlsym(RTLD_DEFAULT, kGlooAllreduce);
  REQUIRE(global != nullptr);
  Dl_info info{};
  REQUIRE(dladdr(global, &info) != 0);
  INFO("the global scope binds gloo::allreduce to " << info.dli_fname);
  CHECK(base_name(info.dli_fname) == "libtorch_cpu.so");
}

TEST_CASE("fmt: no libfmt is loaded; fsdpp formats with LibTorch's fmt, header-only") {
  test::run_ranks(1, [](comm::Comm&) {});
  const auto objects = loaded_objects();
  INFO(fmt::format("{}", fmt::join(objects, "\n")));
  CHECK(count_named(objects, "libfmt") == 0);
#ifndef FMT_HEADER_ONLY
  FAIL("fsdpp must build with FMT_HEADER_ONLY (cmake/fsdppDependencies.cmake)");
#endif
  // The fmt headers this file compiled with are LibTorch's (its include directory comes first), not
  // another fmt on the system's include path.
  CHECK(FMT_VERSION == FSDPP_TORCH_FMT_VERSION);
}

// Note [SentencePiece in its own lookup scope] (src/train/piece_tokenizer.hpp): loaded the usual way,
// libsentencepiece's flag globals were built over libc10's, which made LibTorch abort on every failed
// allocation, in any program that linked fsdpp.
TEST_CASE(
    "SentencePiece: its flags stay its own, LibTorch's stay LibTorch's, and a failed allocation throws") {
  CHECK_FALSE(FLAGS_caffe2_use_fatal_for_enforce);
  const auto tok =
      train::Tokenizer::load(std::string(FSDPP_SOURCE_DIR) + "/recipes/tokenizers/fortunes-bpe-2048.model");
  CHECK(tok->vocab_size() == 2048);
  CHECK(tok->decode(tok->encode("the same text")) == "the same text");
  const auto objects = loaded_objects();
  INFO(fmt::format("{}", fmt::join(objects, "\n")));
  CHECK(count_named(objects, "libfsdpp_sentencepiece") == 1);
  CHECK(count_named(objects, "libsentencepiece.so") == 1);
  CHECK_FALSE(FLAGS_caffe2_use_fatal_for_enforce);
  CHECK_THROWS_AS(c10::GetDefaultCPUAllocator()->allocate(size_t{1} << 52), c10::Error);
}
