#include "fsdpp/fsdp/param_group.hpp"

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/base/storage.hpp"
#include "block_copies.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/EmptyTensor.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstring>
#include <functional>

namespace fsdpp::fsdp {

namespace {

constexpr int64_t kAlign = 16;       // bytes; keeps every dtype view of the gather buffer aligned
constexpr int64_t kParamAlign = 64;  // bytes; where each unsharded parameter starts, as malloc'd ones

int64_t align_up(int64_t x, int64_t to = kAlign) { return (x + to - 1) / to * to; }

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

std::string dtype_name(at::ScalarType t) { return c10::toString(t); }
std::string grad_dtype_name(std::optional<at::ScalarType> t) { return t ? dtype_name(*t) : "none"; }

}  // namespace

using namespace blocks;

ParamGroup::ParamGroup(comm::Comm comm, std::vector<ParamSpec> specs, const MixedPrecisionPolicy& mp,
                       std::string label, int post_forward_group, bool static_buffers,
                       std::optional<comm::Comm> replicate, std::optional<comm::Comm> blocks)
    : comm_(std::move(comm)),
      replicate_(std::move(replicate)),
      blocks_(std::move(blocks)),
      label_(std::move(label)) {
  set_label(label_);
  static_buffers_ = static_buffers;
  const int64_t n = comm_.size(), rank = comm_.rank();
  comm_size_ = n;
  comm_rank_ = rank;
  std::optional<at::ScalarType> widest_grad;
  // Alone in the shard group, the gather slot is laid out as the unsharded buffer is (Note
  // [one-rank buffers]).
  const int64_t slot_align = n == 1 ? kParamAlign : kAlign;
  for (auto& spec : specs) {
    const std::string& name = spec.names.front();
    const at::Tensor& p = spec.param;
    auto fail = [&](const std::string& why) {
      throw std::invalid_argument(fmt::format("fully_shard({}): parameter '{}' {}", label_, name, why));
    };
    if (!p.defined()) fail("is undefined");
    if (&spec == &specs.front()) device_ = p.device();
    if (p.device() != device_)
      fail(fmt::format("is on {} but '{}' is on {}; a unit's parameters must share a device",
                       p.device().str(), specs.front().names.front(), device_.str()));
    if (!p.device().is_cpu() && !p.device().is_cuda())
      fail("is on " + p.device().str() + "; fully_shard shards CPU and CUDA tensors");
    if (!is_float(p.scalar_type()))
      fail(
          fmt::format("has dtype {}; only float32, float64, bfloat16 and float16 parameters can be "
                      "sharded",
                      dtype_name(p.scalar_type())));
    if (p.dim() == 0) fail("is a 0-dim tensor; sharding needs at least one dimension");
    if (!p.is_contiguous()) fail("is not contiguous");

    Param q;
    q.names = spec.names;
    q.param = p;
    q.shape = p.sizes().vec();
    q.rows = p.size(0);
    q.row_numel = 1;
    for (size_t d = 1; d < q.shape.size(); ++d) q.row_numel *= q.shape[d];
    q.padded_rows = (q.rows + n - 1) / n;
    q.row_offset = std::min(q.rows, rank * q.padded_rows);
    q.local_rows = std::clamp<int64_t>(q.rows - rank * q.padded_rows, 0, q.padded_rows);

    auto compute = mp.param_dtype.value_or(p.scalar_type());
    if (mp.param_dtype_override)
      if (auto o = mp.param_dtype_override(name, p)) compute = *o;
    if (!is_float(compute))
      fail(fmt::format("would compute in {}; param_dtype must be a floating-point dtype",
                       dtype_name(compute)));
    // Gradient dtypes by PyTorch 2.15's rules (FSDPParam's sharded_grad_dtype and
    // unsharded_grad_dtype; mixed_precision.hpp): the sharded gradient's is the explicit
    // grad_dtype, else the parameter's own; the unsharded gradient accumulates in reduce_dtype
    // when set, else in that.
    std::optional<GradDtype> explicit_grad;
    if (mp.grad_dtype) explicit_grad = mp.grad_dtype(name, p);
    if (explicit_grad && explicit_grad->dtype && !is_float(*explicit_grad->dtype))
      fail(fmt::format("has grad_dtype {}; it must be a floating-point dtype",
                       dtype_name(*explicit_grad->dtype)));
    q.compute_dtype = compute;
    q.explicit_grad_dtype = explicit_grad.has_value();
    q.sharded_grad_dtype = explicit_grad ? explicit_grad->dtype : p.scalar_type();
    q.unsharded_grad_dtype = mp.reduce_dtype ? mp.reduce_dtype : q.sharded_grad_dtype;
    q.wider_grad =
        q.unsharded_grad_dtype && at::elementSize(*q.unsharded_grad_dtype) > at::elementSize(compute);
    // A gradient without an accumulation dtype (none) is reduced in the dtype it arrives in: the
    // parameter's compute dtype.
    const auto grad = q.unsharded_grad_dtype.value_or(compute);
    if (p.requires_grad()) widest_grad = widest_grad ? at::promote_types(*widest_grad, grad) : grad;

    q.gather_offset = gather_slot_bytes_;
    q.gather_bytes = q.padded_numel() * at::elementSize(compute);
    gather_slot_bytes_ += align_up(q.gather_bytes, slot_align);
    if (p.requires_grad()) {
      q.reduce_offset = reduce_slot_numel_;
      reduce_slot_numel_ += q.padded_numel();
    } else {
      q.reduce_offset = -1;
    }
    params_.push_back(std::move(q));
  }
  reduce_dtype_ = mp.reduce_dtype.value_or(widest_grad.value_or(at::kFloat));
  if (!is_float(reduce_dtype_))
    throw std::invalid_argument(fmt::format("fully_shard({}): reduce_dtype {} is not a floating-point dtype",
                                            label_, dtype_name(reduce_dtype_)));
  check_plan_is_uniform();
  if (post_forward_group > 1)
    group_comm_ = comm_.split(comm_.rank() / post_forward_group, comm_.rank() % post_forward_group);

  // Everything is checked; only now take the parameters over, so a rejected plan leaves the
  // model as it was.
  // Note [unshard by storage resize]: every parameter's place in the one unsharded buffer.
  std::vector<int64_t> offsets, nbytes;
  int64_t unsharded_total = 0;
  for (const auto& q : params_) {
    offsets.push_back(unsharded_total);
    nbytes.push_back(q.numel() * int64_t(at::elementSize(q.compute_dtype)));
    unsharded_total += align_up(nbytes.back(), kParamAlign);
  }
  unsharded_buf_ = at::empty({unsharded_total}, at::TensorOptions(device_).dtype(at::kByte));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& q = params_[i];
    at::NoGradGuard no_grad;
    std::vector<int64_t> padded_shape = q.shape;
    padded_shape[0] = q.padded_rows;
    q.padded = at::zeros(padded_shape, q.param.options());
    if (!is_unallocated(q.param))  // Note [unallocated parameters]: a shard of zeros, to be loaded
      q.padded.narrow(0, 0, q.local_rows).copy_(q.param.narrow(0, q.row_offset, q.local_rows));
    q.sharded = q.padded.narrow(0, 0, q.local_rows).detach().requires_grad_(q.param.requires_grad());
    q.unsharded_offset = offsets[i];
    q.unsharded = unsharded_buf_.narrow(0, offsets[i], nbytes[i]).view(q.compute_dtype).view(q.shape);
    q.param.set_data(q.unsharded);
    // Note [unsharded gradients]: autograd casts each incoming gradient to the accumulation dtype
    // (none: any dtype goes); the sharded parameter reports an explicit grad_dtype, as 2.15's does.
    if (q.param.requires_grad()) {
      q.param.set_grad_dtype(q.unsharded_grad_dtype);
      if (q.explicit_grad_dtype) q.sharded.set_grad_dtype(q.sharded_grad_dtype);
    }
  }
  host_ = device_.is_cpu();
  for (auto& q : params_)
    if (host_ && q.padded.scalar_type() == q.compute_dtype) q.padded_raw = bytes_of(q.padded);
  make_views();
  release(unsharded_buf_);
}

// Through the host buffer cache (Note [host buffer cache]): on the CPU, the buffers one unit
// releases are, size for size, the ones the next unit takes.
char* ParamGroup::allocate(const at::Tensor& t, size_t nbytes) const {
  return static_cast<char*>(resize_storage_bytes_cached(t, nbytes));  // nothing to do when it has that size
}

void ParamGroup::release(const at::Tensor& t) const {
  if (!static_buffers_) resize_storage_bytes_cached(t, 0);
}

std::vector<const void*> ParamGroup::buffer_addresses() const {
  std::vector<const void*> out;
  for (const auto* t : {&gather_buf_, &reduce_buf_, &unsharded_buf_}) out.push_back(t->storage().data());
  return out;
}

// Note [raw copies]
// On the CPU, when no dtype changes hands, a step moves its bytes by memcpy at offsets known since
// construction, reading only the base pointers of the gather and reduce buffers and of each
// parameter's tensors: this rank's padded rows into its slot of the gather buffer, each rank's
// rows out of it into the unsharded parameter, the gradient's rows into the reduce input (the
// padding zeroed), and this rank's reduced rows into a new gradient. A deep model's hundreds of
// units hold more tensors than the caches do, and reading a view's metadata there costs more than
// copying the few bytes it describes. Conversions and CUDA tensors go through the views below.
//
// Note [persistent views]
// The gather and reduce buffers are tensors made once, whose storage is allocated only while a
// collective uses it (as the parameters' own, Note [unshard by storage resize]). Every view that
// packs or unpacks them is made here, once, while the storage exists; a view keeps pointing at the
// storage object across resizes. A step then costs one copy per parameter and direction, not a
// chain of narrow/view calls, which matters for models of many small units.
//
// Note [one-rank buffers]
// A CPU unit alone in its shard group (one rank, or HSDP with one rank per shard group) gathers
// and reduces over one rank, where each collective's output is its input. Its gather buffer is then
// the unsharded buffer itself (the gather slot is laid out as that is: every parameter at its
// 64-byte aligned place, and one rank has no padding rows), so unsharding copies each shard once,
// straight into its parameter, and the all-gather copies nothing. The reduce-scatter's output is
// its input, so reducing copies each gradient in and the result out, and nothing in between. The
// collectives are still issued: the flight recorder, HSDP's replica average and expert
// parallelism's blocks see the same operations as at any size.
void ParamGroup::make_views() {
  const int64_t n = comm_.size();
  if (alone()) {
    TORCH_INTERNAL_ASSERT(gather_slot_bytes_ == unsharded_buf_.numel(), "fsdp: ", label_,
                          "'s gather slot is not laid out as its unsharded buffer");
    gather_buf_ = unsharded_buf_;
  } else {
    gather_buf_ = at::empty({n * gather_slot_bytes_}, at::TensorOptions(device_).dtype(at::kByte));
  }
  gather_slot_ = gather_buf_.narrow(0, comm_.rank() * gather_slot_bytes_, gather_slot_bytes_);
  const auto rows = gather_buf_.view({n, gather_slot_bytes_});
  // The reduce-scatter's input and output share one storage, the output after the input (alone,
  // the output is the input).
  reduce_buf_ = at::empty({(alone() ? n : n + 1) * reduce_slot_numel_},
                          at::TensorOptions(device_).dtype(reduce_dtype_));
  reduce_in_ = reduce_buf_.narrow(0, 0, n * reduce_slot_numel_);
  const auto reduce_rows = reduce_in_.view({n, reduce_slot_numel_});
  reduce_out_ = alone() ? reduce_in_ : reduce_buf_.narrow(0, n * reduce_slot_numel_, reduce_slot_numel_);
  for (auto& q : params_) {
    const int64_t pn = q.padded_numel();
    if (pn == 0) continue;
    q.copy_in =
        gather_slot_.narrow(0, q.gather_offset, q.gather_bytes).view(q.compute_dtype).view(q.padded.sizes());
    // Rank r's rows of this parameter sit at [r, offset .. offset + bytes) of the gather buffer,
    // and at elements [r * pn, (r + 1) * pn) of the unsharded parameter, the last ones cut short.
    const auto src = rows.narrow(1, q.gather_offset, q.gather_bytes).view(q.compute_dtype);
    const auto dst = q.unsharded.view(-1);
    const int64_t full = q.full_pieces(), rest = q.last_piece();
    TORCH_INTERNAL_ASSERT(!alone() || q.gather_offset == q.unsharded_offset);
    if (!alone()) {  // alone, the gathered bytes are the unsharded parameters
      if (full > 0)
        q.copy_out.emplace_back(dst.narrow(0, 0, full * pn).view({full, pn}), src.narrow(0, 0, full));
      if (rest > 0) q.copy_out.emplace_back(dst.narrow(0, full * pn, rest), src[full].narrow(0, 0, rest));
    }
    if (q.reduce_offset < 0) continue;
    q.reduce_all = reduce_rows.narrow(1, q.reduce_offset, pn);
    if (full > 0) q.pack.push_back({q.reduce_all.narrow(0, 0, full), 0});
    if (rest > 0) {
      q.pack.push_back({q.reduce_all[full].narrow(0, 0, rest), full * pn});
      q.pad.push_back(q.reduce_all[full].narrow(0, rest, pn - rest));
    }
    const int64_t used = full + (rest > 0);
    if (used < n) q.pad.push_back(q.reduce_all.narrow(0, used, n - used));
    auto local_shape = q.shape;
    local_shape[0] = q.local_rows;
    q.reduce_piece = reduce_out_.narrow(0, q.reduce_offset, q.local_rows * q.row_numel).view(local_shape);
  }
  release(gather_buf_);
  release(reduce_buf_);
}

// Per-parameter dtype choices come from user callables; a rank that decides differently would
// all-gather a different number of bytes and hang or corrupt. Compare a fingerprint of every
// parameter's plan across ranks once, here.
void ParamGroup::check_plan_is_uniform() {
  const int64_t n = comm_.size();
  const int64_t count = static_cast<int64_t>(params_.size());
  const auto on_device = at::TensorOptions(device_).dtype(at::kLong);
  auto counts = at::empty({n}, on_device);
  comm_.all_gather(counts, at::full({1}, count, on_device)).wait();
  counts = counts.cpu();
  for (int64_t q = 0; q < n; ++q)
    if (counts[q].item<int64_t>() != count)
      throw std::invalid_argument(
          fmt::format("fully_shard({}): rank {} shards {} parameters but rank {} shards {}; every rank must "
                      "wrap the same model",
                      label_, comm_.rank(), count, q, counts[q].item<int64_t>()));
  if (count == 0) return;
  auto mine = at::empty({count}, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    const auto& q = params_[i];
    const std::string plan = fmt::format("{}|{}|{}|{}|{}|{}", q.names.front(), fmt::join(q.shape, "x"),
                                         dtype_name(q.compute_dtype), grad_dtype_name(q.unsharded_grad_dtype),
                                         grad_dtype_name(q.sharded_grad_dtype), q.param.requires_grad());
    mine[i] = static_cast<int64_t>(std::hash<std::string>{}(plan));
  }
  auto all = at::empty({n * count}, on_device);
  comm_.all_gather(all, mine.to(device_)).wait();
  all = all.cpu();
  auto view = all.view({n, count});
  for (int64_t q = 0; q < n; ++q)
    for (int64_t i = 0; i < count; ++i)
      if (view[q][i].item<int64_t>() != mine[i].item<int64_t>()) {
        const auto& p = params_[i];
        throw std::invalid_argument(
            fmt::format("fully_shard({}): ranks {} and {} disagree on parameter '{}' (this rank: shape {}, "
                        "compute dtype {}, grad dtype {}); param_dtype_override and grad_dtype must give the "
                        "same answer on every rank",
                        label_, comm_.rank(), q, p.names.front(), fmt::join(p.shape, "x"),
                        dtype_name(p.compute_dtype), grad_dtype_name(p.sharded_grad_dtype)));
      }
}

void ParamGroup::unshard_async() {
  if (unsharded_ || gather_work_) return;
  char* gathered = gathered_raw_ = allocate(gather_buf_, gather_buf_.numel());
  if (group_shard_.defined()) {
    // After reshard_to_group: the buffer is split in N contiguous pieces, one per group member.
    comm::OpLabel op_label("fsdp group all_gather " + label_);
    gather_work_ = group_comm_.all_gather(gather_buf_, group_shard_);
    group_shard_ = at::Tensor();
    return;
  }
  char* slot = host_ ? gathered + comm_rank_ * gather_slot_bytes_ : nullptr;
  for (const auto& q : params_) {
    if (q.padded_numel() == 0) continue;
    if (slot && q.padded_raw)  // Note [raw copies]
      std::memcpy(slot + q.gather_offset, q.padded_raw, q.gather_bytes);
    else
      copy_block(q.copy_in, q.padded);  // casts to the compute dtype
  }
  comm::OpLabel op_label(&gather_label_);
  gather_work_ = comm_.all_gather(gather_buf_, gather_slot_);
}

void ParamGroup::wait_unshard() {
  if (unsharded_) return;
  unshard_async();
  gather_work_->wait();
  gather_work_.reset();
  if (alone()) {  // Note [one-rank buffers]: the gather filled the parameters' own buffer
    unsharded_ = true;
    return;
  }
  const char* gathered = host_ ? gathered_raw_ : nullptr;
  char* unsharded = allocate(unsharded_buf_, unsharded_buf_.numel());
  for (auto& q : params_) {
    const int64_t pn = q.padded_numel();
    if (!gathered) {
      for (auto& [dst, src] : q.copy_out) copy_block(dst, src);
    } else if (pn > 0) {  // Note [raw copies]: rank r's rows, then the last rank's partial ones
      const int64_t es = at::elementSize(q.compute_dtype), full = q.full_pieces(), rest = q.last_piece();
      char* dst = unsharded + q.unsharded_offset;
      const char* src = gathered + q.gather_offset;
      copy_strided(dst, pn * es, src, gather_slot_bytes_, full, pn * es);
      if (rest > 0) std::memcpy(dst + full * pn * es, src + full * gather_slot_bytes_, rest * es);
    }
  }
  if (!group_comm_) release(gather_buf_);  // reshard_to_group still needs it
  unsharded_ = true;
}

void ParamGroup::reshard_to_group() {
  if (!unsharded_) return;
  TORCH_INTERNAL_ASSERT(group_comm_, "fsdp: reshard_to_group without a group");
  const int64_t piece = gather_buf_.numel() / group_comm_.size();
  group_shard_ = gather_buf_.narrow(0, group_comm_.rank() * piece, piece).clone();
  release(gather_buf_);
  release(unsharded_buf_);
  unsharded_ = false;
}

void ParamGroup::reshard() {
  if (gather_work_) {  // a prefetch nobody used: let it land, then drop it
    gather_work_->wait();
    gather_work_.reset();
  }
  group_shard_ = at::Tensor();
  release(gather_buf_);
  if (!unsharded_) return;
  release(unsharded_buf_);
  unsharded_ = false;
}

std::vector<at::Tensor> ParamGroup::sharded_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& q : params_) out.push_back(q.sharded);
  return out;
}

void ParamGroup::set_label(const std::string& label) {
  label_ = label;
  gather_label_ = "fsdp all_gather " + label_;
  reduce_label_ = "fsdp reduce_scatter " + label_;
  replicate_label_ = "fsdp all_reduce (replicas) " + label_;
}

int64_t ParamGroup::unsharded_bytes() const {
  int64_t n = 0;
  for (const auto& q : params_) n += q.numel() * int64_t(at::elementSize(q.compute_dtype));
  return n;
}

int64_t ParamGroup::held_bytes() const {
  const auto bytes = [](const at::Tensor& t) { return t.defined() ? int64_t(t.storage().nbytes()) : 0; };
  return bytes(unsharded_buf_) + (alone() ? 0 : bytes(gather_buf_)) + bytes(group_shard_);
}

std::vector<int64_t> ParamGroup::whole_shape(const Param& q) const {
  auto shape = q.shape;
  shape[0] *= block_count();
  return shape;
}

std::vector<ShardInfo> ParamGroup::shard_infos() const {
  std::vector<ShardInfo> out;
  for (const auto& q : params_)
    out.push_back({q.names, whole_shape(q), whole_row_offset(q), q.local_rows, q.padded_rows, q.compute_dtype,
                   q.sharded_grad_dtype});
  return out;
}

std::vector<at::Tensor> ParamGroup::gather_full_params() {
  std::vector<at::Tensor> out;
  const int64_t n = comm_.size();
  for (const auto& q : params_) {
    auto shape = q.shape;
    shape[0] = n * q.padded_rows;
    auto full = at::empty(shape, q.padded.options());
    comm_.all_gather(full.view(-1), q.padded.view(-1)).wait();
    auto block = full.narrow(0, 0, q.rows).contiguous();
    if (block_count() > 1) {
      auto whole = at::empty(whole_shape(q), q.padded.options());
      blocks_->all_gather(whole.view(-1), block.view(-1)).wait();
      out.push_back(std::move(whole));
    } else {
      out.push_back(block.clone());
    }
  }
  return out;
}

void ParamGroup::load_full_params(const std::vector<at::Tensor>& full) {
  TORCH_CHECK(full.size() == params_.size(), "fsdp: ", full.size(), " tensors for ", params_.size(),
              " parameters of ", label_);
  at::NoGradGuard no_grad;
  reshard();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& q = params_[i];
    const auto whole = whole_shape(q);
    if (full[i].sizes().vec() != whole)
      throw std::invalid_argument(
          fmt::format("load: parameter '{}' has shape [{}] in the state dict "
                      "but [{}] in the model",
                      q.names.front(), fmt::join(full[i].sizes(), ", "), fmt::join(whole, ", ")));
    q.padded.narrow(0, 0, q.local_rows).copy_(full[i].narrow(0, whole_row_offset(q), q.local_rows));
  }
}

}  // namespace fsdpp::fsdp
