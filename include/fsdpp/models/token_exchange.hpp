#pragma once
// How an MoE layer's routed rows reach the ranks that hold their experts (expert parallelism). The
// model knows nothing of communicators: whoever shards it hands each layer an exchange, as
// train::apply_expert_parallel (train/sharding.hpp) does with one over a comm::Comm. An exchange
// must be collective across its ranks: every rank calls the same exchanges in the same order.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace fsdpp::models {

class TokenExchange {
 public:
  virtual ~TokenExchange() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Equal parts of `in` to every rank, rank-major; `out` (same size) receives every rank's part
  // for this one. The dropless layer sends its per-expert row counts this way.
  virtual void exchange_counts(const at::Tensor& out, const at::Tensor& in) = 0;
  // Rows of x [N, width]: send_rows[j] of them, in order, to rank j; returns the rows that arrive,
  // recv_rows[j] from rank j, in rank order. `label` names the exchange in traces and records.
  virtual at::Tensor exchange_rows(const at::Tensor& x, const std::vector<int64_t>& send_rows,
                                   const std::vector<int64_t>& recv_rows, const std::string& label) = 0;
};

}  // namespace fsdpp::models
