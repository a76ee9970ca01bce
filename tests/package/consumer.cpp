// Sums a tensor across the ranks it is launched with; prints the result for the test to check.
// Includes a header of each installed area, as a user's program would.
#include <ATen/ATen.h>
#include <fsdpp/comm/init.hpp>
#include <fsdpp/fsdp/fully_shard.hpp>
#include <fsdpp/pipeline/plan.hpp>

#include <iostream>

int main() {
  auto comm = fsdpp::comm::init_from_env();
  auto t = at::full({8}, comm.rank() + 1.0);
  comm.all_reduce(t).wait();
  const auto plan =
      fsdpp::pipeline::make_plan(*fsdpp::pipeline::make_schedule("1F1B"), {.pp = 2, .microbatches = 4});
  fsdpp::fsdp::FullyShardOptions options{.reshard_after_forward = true};
  std::cout << "consumer rank " << comm.rank() << " sum " << t[7].item<double>() << std::endl;
  if (plan.lowered.size() != 2 || !options.reshard_after_forward) return 1;
}
