// The smallest fsdpp program: sum a tensor across ranks.
//   fsdpp launch --nproc 3 -- build/example_all_reduce
#include <ATen/ATen.h>

#include <iostream>

#include "fsdpp/comm/init.hpp"

int main() {
  auto comm = fsdpp::comm::init_from_env();
  auto t = at::full({4}, comm.rank() + 1.0);
  comm.all_reduce(t).wait();  // every element becomes 1 + 2 + ... + size
  std::cout << "rank " << comm.rank() << " of " << comm.size() << ": " << t[0].item<double>() << "\n";
}
