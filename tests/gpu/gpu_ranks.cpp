// A GPU rank for the device check (scripts/gpu-check.sh), started as processes under
//   fsdpp launch --nproc N [--share-gpu] -- fsdpp_test_gpu_ranks
// so that world sizes above the machine's GPU count run too (ranks sharing a GPU, each with its own
// NCCL_HOSTID). Checks every collective in float32 and bfloat16 (tests/gpu/collectives.hpp), then
// the same collectives captured into a CUDA graph with a watchdog polling: three replays give what
// three eager runs give, and the communicator works afterwards. Prints "rank R/N ok" or the failures
// and exits 1.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>

#include <iostream>

#include "fsdpp/base/cuda_graph.hpp"
#include "fsdpp/comm/init.hpp"
#include "gpu/collectives.hpp"

using namespace fsdpp;

int main() {
  try {
    comm::InitOptions o;
    o.backend = comm::Backend::kNccl;
    o.watchdog_timeout = std::chrono::seconds(30);  // polls every 100 ms, as under fsdpp run
    o = comm::with_watchdog_from_env(o);            // the device check puts the flight records in its logs
    auto comm = comm::init_from_env(o);
    const int r = comm.rank(), n = comm.size(), d = current_cuda_device();
    auto bad = test::check_collectives(comm, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)));

    const auto opts = at::TensorOptions(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)));
    auto eager = at::arange(8 * n, opts).add(r);
    auto graphed = eager.clone();
    for (int i = 0; i < 4; ++i) test::round_trip(comm, eager);
    CapturedStep::warm_up([&] { test::round_trip(comm, graphed); });  // as the trainer's eager steps
    auto step = CapturedStep::capture([&] { test::round_trip(comm, graphed); });
    for (int i = 0; i < 3; ++i) step->replay();
    if (!at::equal(eager.cpu(), graphed.cpu())) bad.push_back("captured collectives differ from eager ones");
    auto after = at::full({2}, 1.0, opts);
    comm.all_reduce(after).wait();
    if (!at::equal(after.cpu(), at::full({2}, double(n)))) bad.push_back("all_reduce after the replays");
    comm.barrier().wait();
    for (const auto& b : bad) std::cerr << "FAILED: " << b << "\n";
    if (!bad.empty()) return 1;
    std::cout << "rank " << r << "/" << n << " on GPU " << d << " ok: collectives in float32 and bfloat16, "
              << "captured collectives equal to eager" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "FAILED: " << e.what() << std::endl;
    return 1;
  }
}
