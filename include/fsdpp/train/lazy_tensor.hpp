#pragma once
// A full tensor read a range of rows at a time: how a run loads weights it cannot hold whole
// (model.init_from), each rank reading only the rows of its shards.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdpp::train {

struct LazyTensor {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  // Rows [first, first + count) along dim 0, made when called: a view of a file mapped into memory,
  // or those rows of a tensor the file keeps as several (a transformers checkpoint's q, k and v
  // projections, its experts one by one), joined only for these rows.
  std::function<at::Tensor(int64_t first, int64_t count)> rows;

  at::Tensor make() const { return rows(0, shape.front()); }
};

// A tensor held as it is: its rows are views of it.
inline LazyTensor lazy_view(std::string name, const at::Tensor& t) {
  return {std::move(name), t.scalar_type(), t.sizes().vec(),
          [t](int64_t first, int64_t count) { return t.narrow(0, first, count); }};
}

}  // namespace fsdpp::train
