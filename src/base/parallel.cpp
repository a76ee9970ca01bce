#include "fsdpp/base/parallel.hpp"

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>

namespace fsdpp {

// A TensorIterator over a [count] scratch tensor lays out the ranges, and LibTorch's own parallel
// loop runs them: at::parallel_for would run them on one thread here, where the OpenMP pragmas of
// its inline implementation are not compiled.
void parallel_ranges(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (count <= 0) return;
  if (count <= grain) return body(0, count);
  const auto marks = at::empty({count}, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  auto iter =
      at::TensorIteratorConfig().add_output(marks).resize_outputs(false).check_all_same_dtype(false).build();
  const char* base = static_cast<const char*>(marks.data_ptr());
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t n0, int64_t n1) {
        for (int64_t j = 0; j < n1; ++j) {
          const int64_t begin = (data[0] + j * strides[1]) - base;
          body(begin, begin + n0);
        }
      },
      grain);
}

}  // namespace fsdpp
