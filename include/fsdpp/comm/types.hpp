#pragma once
// Options structs for each communication operation (one struct per operation, so call sites stay
// short and fields can be added later), and the error type every failure surfaces as.

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdpp::comm {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

const char* to_string(ReduceOp op);

inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(5);

struct AllGatherOptions {
  // Elements contributed by each rank; empty means every rank contributes in.numel().
  std::vector<int64_t> counts;
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
};

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
};

struct BroadcastOptions {
  int root = 0;
};

struct AllToAllOptions {
  // Elements sent to / received from each rank; both empty means equal splits.
  std::vector<int64_t> in_splits;
  std::vector<int64_t> out_splits;
};

// A failed communication operation or rendezvous. The message names the rank, the operation and
// the sizes involved.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fsdpp::comm
