// A parameter group's gradient half: accumulation across microbatches, the reduce-scatter (and
// HSDP's all-reduce over replicas), and the spare gradient buffers (param_group.hpp).
#include "fsdpp/fsdp/param_group.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <utility>

#include "block_copies.hpp"
#include "fsdpp/base/storage.hpp"
#include "fsdpp/comm/flight_recorder.hpp"

namespace fsdpp::fsdp {

using namespace blocks;

// Note [unsharded gradients]
// A parameter's unsharded gradient lives in its own .grad (the module's parameter, which fsdpp
// keeps unsharded in identity), where autograd's AccumulateGrad sums the microbatches, as PyTorch
// 2.15 keeps it in its unsharded parameter's .grad. The dtypes are 2.15's: each parameter's
// grad_dtype (set at sharding) is its accumulation dtype, so autograd casts each incoming gradient
// to it. Where that dtype is wider than the compute dtype, the cast is deferred when it changes no
// bit: a gradient that goes to the reduce-scatter as it is (packing casts it), or one added in
// place to a wider .grad (AccumulateGrad adds a narrower gradient into it). Only a gradient that
// starts a no-sync sum is cast as it arrives. The reduce-scatter takes the gradients, so .grad is
// undefined after a synchronising backward, and the reduced shard goes to the sharded parameter's
// .grad in its sharded grad dtype.
void ParamGroup::defer_grad_upcasts(bool reducing) {
  for (auto& q : params_)
    if (q.wider_grad && q.param.requires_grad() && (reducing || q.param.grad().defined()))
      q.param.set_grad_dtype(std::nullopt);
}

void ParamGroup::restore_grad_dtypes() {
  for (auto& q : params_) {
    if (!q.wider_grad || !q.param.requires_grad()) continue;
    at::Tensor& g = q.param.mutable_grad();
    if (g.defined() && g.scalar_type() != *q.unsharded_grad_dtype) {
      at::NoGradGuard no_grad;
      g = g.to(*q.unsharded_grad_dtype);
    }
    q.param.set_grad_dtype(q.unsharded_grad_dtype);
  }
}

bool ParamGroup::has_stray_grads() const {
  for (const auto& q : params_)
    if (q.param.grad().defined()) return true;
  return false;
}

void ParamGroup::reduce_grads_async() {
  for (auto& q : params_) q.taken_grad = std::exchange(q.param.mutable_grad(), at::Tensor());
  restore_grad_dtypes();
  if (reduce_slot_numel_ == 0) return;
  TORCH_INTERNAL_ASSERT(!reduce_pending_, "fsdp: reduce-scatter issued twice for ", label_);
  char* reduce_in = reduce_raw_ = allocate(reduce_buf_, reduce_buf_.numel() * reduce_buf_.element_size());
  {
    NoGradFromHere no_grad;
    for (auto& q : params_) {
      if (!q.reduce_all.defined()) continue;
      if (host_ && pack_raw(q, reduce_in)) continue;
      no_grad();
      // A parameter that got no gradient here (an expert that saw no tokens) is reduced as zeros,
      // so every rank still issues the same collective.
      if (!q.taken_grad.defined()) {
        zero_block(q.reduce_all);
        continue;
      }
      for (const auto& p : q.pack) copy_from_flat(p.dst, q.taken_grad, p.offset);
      for (auto& z : q.pad) zero_block(z);
      q.taken_grad = at::Tensor();
    }
  }
  comm::OpLabel op_label(&reduce_label_);
  reduce_work_ = comm_.reduce_scatter(reduce_out_, reduce_in_, {comm::ReduceOp::kAvg});
  reduce_pending_ = true;
  // Alone in the shard group, on every rank alike, the reduce-scatter is done already (Note
  // [one-rank buffers]): the replicas' average can go out now, while the backward goes on.
  if (alone()) average_replicas_async();
}

// Note [replica average]
// With replicas (HSDP), a unit's reduced shard is averaged again across them by an all-reduce,
// which can only go out once the reduce-scatter has landed. It is issued, not waited for: in a
// shard group of one rank (HSDP as data parallelism), where the reduce-scatter completes as it is
// issued, from the unit's post-backward, so that the all-reduce overlaps the rest of the backward
// as reduce-scatters do; otherwise at the end of the backward, every unit's before the first is
// waited for, so that the replica communicator runs them back to back. Either way every rank of
// a replica group issues them in the same order: which case applies depends on the shard group's
// size only, the same on every rank.
void ParamGroup::average_replicas_async() {
  if (!reduce_work_) return;
  reduce_work_->wait();
  reduce_work_.reset();
  // Expert parallelism: each block's gradient summed the tokens of every rank holding a block, so
  // the average over the shard group counts them block_count() times.
  if (block_count() > 1) reduce_out_.div_(double(block_count()));
  if (replicate_ && replicate_->size() > 1) {
    // HSDP: the shard group's average, averaged again over the replicas (equal group sizes make
    // it the average over every data-parallel rank).
    comm::OpLabel op_label(&replicate_label_);
    replicate_work_ = replicate_->all_reduce(reduce_out_, {comm::ReduceOp::kAvg});
  }
}

void ParamGroup::finish_reduce() {
  if (!reduce_pending_) return;
  average_replicas_async();
  if (replicate_work_) {
    replicate_work_->wait();
    replicate_work_.reset();
  }
  reduce_pending_ = false;
  NoGradFromHere no_grad;
  const bool keep_spares = host_ && host_buffer_cache_limit() > 0;
  // reduce_out_ follows the ranks' slots of the input (alone, it is the input)
  const char* reduced =
      host_ ? reduce_raw_ + reduce_out_.storage_offset() * at::elementSize(reduce_dtype_) : nullptr;
  for (auto& q : params_) {
    if (q.reduce_offset < 0) continue;
    at::Tensor& g = q.sharded.mutable_grad();
    // The sharded gradient's dtype (none: the reduce dtype); 2.15 casts the reduced shard to it
    // before adding it to an existing gradient.
    const auto dtype = q.sharded_grad_dtype.value_or(reduce_dtype_);
    if (!q.reduce_piece.defined()) {  // a parameter with no rows anywhere
      no_grad();
      if (!g.defined()) g = at::zeros_like(q.sharded, at::TensorOptions().dtype(dtype));
      continue;
    }
    if (g.defined()) {
      no_grad();
      g.add_(dtype == reduce_dtype_ ? q.reduce_piece : q.reduce_piece.to(dtype));
    } else if (host_ && dtype == reduce_dtype_) {  // Note [raw copies]
      g = spare_or_new_grad(q, dtype, keep_spares);
      const int64_t es = at::elementSize(reduce_dtype_);
      std::memcpy(bytes_of(g), reduced + q.reduce_offset * es, q.local_rows * q.row_numel * es);
    } else {
      no_grad();
      g = empty_like_plain(q.sharded, dtype);
      copy_block(g, q.reduce_piece);
    }
  }
  release(reduce_buf_);
}

// Note [spare gradients]
// An optimizer's zero_grad(set_to_none) drops each sharded gradient, and the next backward would
// allocate it again: per parameter per step, an allocation and a free that the unsharded model
// does not make (its AccumulateGrad takes the incoming gradient as it is). On the CPU, while the
// host buffer cache is on (Note [host buffer cache]), a group keeps the last gradient it handed
// out and, when nothing else holds that tensor or its storage any more, refills it instead. A
// gradient still held elsewhere (kept by the caller, or a view of it) is never written: a new
// one is made. The memory kept is one sharded gradient per parameter, 1/N of the unsharded ones.
at::Tensor ParamGroup::spare_or_new_grad(Param& q, at::ScalarType dtype, bool keep) {
  at::Tensor& spare = q.spare_grad;
  if (!keep) {
    spare = at::Tensor();
    return empty_like_plain(q.sharded, dtype);
  }
  if (!spare.defined() || spare.use_count() != 1 || spare.storage().use_count() != 1 ||
      spare.sizes() != q.sharded.sizes() || spare.scalar_type() != dtype) {
    spare = empty_like_plain(q.sharded, dtype);
  } else if (spare.unsafeGetTensorImpl()->autograd_meta()) {
    // torch::optim's zero_grad detach_()es a gradient before dropping it, which gives the tensor
    // autograd metadata. Kept, it would send every optimizer operation reading this gradient
    // through the forward-AD check that locks the metadata's mutex (about 400 instructions per
    // parameter per step); a gradient fresh from backward has none. Nothing else holds the tensor.
    spare.unsafeGetTensorImpl()->set_autograd_meta(nullptr);
  }
  return spare;
}

// Note [raw copies]: rank r's part of the gradient (padded_numel elements from r * padded_numel)
// goes to row r of the parameter's region in the reduce input; what lies past the gradient's end is
// zeroed, as all of it is for a parameter that got no gradient. False when a dtype conversion or a
// strided gradient needs ATen.
bool ParamGroup::pack_raw(Param& q, char* reduce_in) {
  const at::Tensor& g = q.taken_grad;
  if (g.defined() && (g.scalar_type() != reduce_dtype_ || !g.is_contiguous() || !g.device().is_cpu()))
    return false;
  const int64_t es = at::elementSize(reduce_dtype_), pn = q.padded_numel(), n = comm_size_;
  const int64_t row_stride = reduce_slot_numel_ * es;
  char* dst = reduce_in + q.reduce_offset * es;
  int64_t used = 0;
  if (g.defined()) {
    const int64_t full = q.full_pieces(), rest = q.last_piece();
    const char* src = bytes_of(g);
    copy_strided(dst, row_stride, src, pn * es, full, pn * es);
    used = full;
    if (rest > 0) {
      std::memcpy(dst + full * row_stride, src + full * pn * es, rest * es);
      std::memset(dst + full * row_stride + rest * es, 0, (pn - rest) * es);
      used = full + 1;
    }
    q.taken_grad = at::Tensor();
  }
  for (int64_t r = used; r < n; ++r) std::memset(dst + r * row_stride, 0, pn * es);
  return true;
}

}  // namespace fsdpp::fsdp
