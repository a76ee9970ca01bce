#pragma once
// A way onto ATen's intra-op threads from code built without OpenMP.
#include <cstdint>
#include <functional>

namespace fsdpp {

// body(begin, end) over [0, count) in ranges of at least `grain`, on ATen's intra-op threads. With
// grain 1 and count the number of threads, each thread runs one index.
void parallel_ranges(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

}  // namespace fsdpp
