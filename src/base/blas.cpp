#include "fsdpp/base/blas.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <fmt/format.h>
#include <limits.h>
#include <link.h>
#include <stdlib.h>

#include <chrono>

namespace fsdpp {

namespace {

int collect(dl_phdr_info* info, size_t, void* data) {
  auto* out = static_cast<std::vector<std::string>*>(data);
  if (info->dlpi_name && *info->dlpi_name) out->emplace_back(info->dlpi_name);
  return 0;
}

std::string classify(const std::string& path) {
  if (path.find("openblas-pthread") != std::string::npos) return "OpenBLAS (pthread)";
  if (path.find("openblas-openmp") != std::string::npos) return "OpenBLAS (OpenMP)";
  if (path.find("openblas-serial") != std::string::npos) return "OpenBLAS (serial)";
  if (path.find("openblas") != std::string::npos) return "OpenBLAS";
  if (path.find("blis") != std::string::npos) return "BLIS";
  if (path.find("atlas") != std::string::npos) return "ATLAS";
  if (path.find("mkl") != std::string::npos) return "MKL";
  if (path.find("/blas/") != std::string::npos) return "reference BLAS (slow: install libopenblas0-pthread)";
  return "unknown";
}

}  // namespace

BlasInfo probe_blas(bool measure) {
  BlasInfo info;
  std::vector<std::string> libs;
  dl_iterate_phdr(collect, &libs);
  for (const auto& lib : libs) {
    const auto base = lib.substr(lib.rfind('/') + 1);
    if (base.rfind("libblas.so", 0) != 0 && base.find("openblas") == std::string::npos &&
        base.find("mkl_core") == std::string::npos)
      continue;
    char real[PATH_MAX];
    info.library = realpath(lib.c_str(), real) ? real : lib;
    info.kind = classify(info.library);
    break;
  }
  if (info.library.empty()) {
    // PyTorch's wheels link their BLAS (MKL on x86) into libtorch_cpu.so; its build settings say which.
    const std::string config = at::show_config();
    const auto key = config.find("BLAS_INFO=");
    const auto end = key == std::string::npos ? key : config.find_first_of(", \n", key);
    info.library = "inside libtorch_cpu.so";
    info.kind = key == std::string::npos ? "unknown" : config.substr(key + 10, end - key - 10);
  }
  if (measure) {
    const int64_t n = 1024;
    auto a = at::randn({n, n}), b = at::randn({n, n});
    auto c = at::mm(a, b);  // warm-up: thread pool and first-touch
    int iters = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double secs = 0;
    while (secs < 0.3 || iters < 2) {
      at::mm_out(c, a, b);
      ++iters;
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    info.matmul_gflops = 2.0 * n * n * n * iters / secs / 1e9;
  }
  return info;
}

std::string describe(const BlasInfo& info) {
  return fmt::format("BLAS: {} [{}], float32 1024x1024 matmul {:.1f} GFLOP/s on {} thread(s)", info.kind,
                     info.library, info.matmul_gflops, at::get_num_threads());
}

}  // namespace fsdpp
