#include "fsdpp/fsdp/param_group.hpp"

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/base/storage.hpp"

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

constexpr int64_t kAlign = 16;  // bytes; keeps every dtype view of the gather buffer aligned
constexpr int64_t kParamAlign = 64;  // bytes; where each unsharded parameter starts, as malloc'd ones

int64_t align_up(int64_t x, int64_t to = kAlign) { return (x + to - 1) / to * to; }

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

std::string dtype_name(at::ScalarType t) { return c10::toString(t); }

// Copies between the persistent views are mostly same-dtype blocks of contiguous rows. For the many
// small units of a deep model, ATen's generic copy (a TensorIterator per call) costs more than the
// bytes themselves, so such blocks go through memcpy; anything else (a dtype cast) through ATen.
bool rows_view(const at::Tensor& t) {
  return t.device().is_cpu() && (t.dim() == 1 ? t.stride(0) == 1 || t.numel() <= 1
                                              : t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1));
}

bool plain_bytes(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); }

// `rows` rows of `row_bytes` bytes, one every d_stride bytes at d, from one every s_stride at s.
void copy_strided(char* d, int64_t d_stride, const char* s, int64_t s_stride, int64_t rows, size_t row_bytes) {
  if (row_bytes == 0) return;
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * d_stride, s + r * s_stride, row_bytes);
}

// dst (a rows view) <- its rows read from s, one every s_stride bytes.
void copy_rows(const at::Tensor& dst, const char* s, int64_t s_stride) {
  const int64_t rows = dst.dim() == 2 ? dst.size(0) : 1;
  const size_t row_bytes = (dst.dim() == 2 ? dst.size(1) : dst.numel()) * dst.element_size();
  const int64_t ds = dst.dim() == 2 ? dst.stride(0) * dst.element_size() : 0;
  if (row_bytes > 0) copy_strided(static_cast<char*>(dst.data_ptr()), ds, s, s_stride, rows, row_bytes);
}

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

void copy_block(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.scalar_type() == src.scalar_type() && dst.numel() == src.numel() && plain_bytes(dst) &&
      plain_bytes(src)) {
    if (dst.numel() > 0) std::memcpy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    return;
  }
  if (dst.scalar_type() != src.scalar_type() || dst.sizes() != src.sizes() || !rows_view(dst) ||
      !rows_view(src)) {
    dst.copy_(src);
    return;
  }
  const int64_t src_stride = src.dim() == 2 ? src.stride(0) * src.element_size() : 0;
  copy_rows(dst, static_cast<const char*>(src.data_ptr()), src_stride);
}

// dst (one of a parameter's pack views) <- src's elements [offset, offset + dst.numel()), in order.
// A contiguous CPU src of dst's dtype is read in place: no flattening or narrowing views.
void copy_from_flat(const at::Tensor& dst, const at::Tensor& src, int64_t offset) {
  if (dst.scalar_type() != src.scalar_type() || !plain_bytes(src) || !rows_view(dst)) {
    copy_block(dst, src.reshape(-1).narrow(0, offset, dst.numel()).view(dst.sizes()));
    return;
  }
  const int64_t row_numel = dst.dim() == 2 ? dst.size(1) : dst.numel();  // src rows are back to back
  copy_rows(dst, static_cast<const char*>(src.data_ptr()) + offset * src.element_size(),
            row_numel * src.element_size());
}

// An uninitialised tensor of t's shape and dtype; on the CPU made directly, not through the
// dispatcher (this runs for every sharded parameter in every step).
at::Tensor empty_like_plain(const at::Tensor& t) {
  if (t.device().is_cpu()) return at::detail::empty_cpu(t.sizes(), t.scalar_type(), false, std::nullopt);
  return at::empty_like(t, at::MemoryFormat::Contiguous);
}

// Grad mode off from the first call on, for the rest of the scope. A gradient handled by memcpy
// records nothing; turning grad mode off and on costs two thread-local lookups, for every unit in
// every step, so it is turned off only before an ATen operation (one on gradients that require
// grad themselves, from a backward that builds their graph, would otherwise be recorded).
// (A flag and the mode it found rather than an optional guard: GCC takes an empty optional's
// destructor for a read of the guard it never made.)
class NoGradFromHere {
 public:
  NoGradFromHere() = default;
  NoGradFromHere(const NoGradFromHere&) = delete;
  NoGradFromHere& operator=(const NoGradFromHere&) = delete;
  ~NoGradFromHere() {
    if (off_) c10::GradMode::set_enabled(before_);
  }
  void operator()() {
    if (off_) return;
    before_ = c10::GradMode::is_enabled();
    c10::GradMode::set_enabled(false);
    off_ = true;
  }

 private:
  bool off_ = false, before_ = true;
};

void zero_block(const at::Tensor& t) {
  if (!rows_view(t)) {
    t.zero_();
    return;
  }
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1;
  const size_t row_bytes = (t.dim() == 2 ? t.size(1) : t.numel()) * t.element_size();
  auto* d = static_cast<char*>(t.data_ptr());
  const int64_t ds = t.dim() == 2 ? t.stride(0) * t.element_size() : 0;
  for (int64_t r = 0; r < rows; ++r) std::memset(d + r * ds, 0, row_bytes);
}

}  // namespace

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
      fail(fmt::format("is on {} but '{}' is on {}; a unit's parameters must share a device", p.device().str(),
                       specs.front().names.front(), device_.str()));
    if (!p.device().is_cpu() && !p.device().is_cuda())
      fail("is on " + p.device().str() + "; fully_shard shards CPU and CUDA tensors");
    if (!is_float(p.scalar_type()))
      fail(fmt::format("has dtype {}; only float32, float64, bfloat16 and float16 parameters can be "
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
    auto grad = compute;
    if (mp.grad_dtype)
      if (auto g = mp.grad_dtype(name, p)) grad = *g;
    if (!is_float(grad))
      fail(fmt::format("has grad_dtype {}; it must be a floating-point dtype", dtype_name(grad)));
    q.compute_dtype = compute;
    q.grad_dtype = grad;
    if (p.requires_grad())
      widest_grad = widest_grad ? at::promote_types(*widest_grad, grad) : grad;

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
    q.padded.narrow(0, 0, q.local_rows).copy_(q.param.narrow(0, q.row_offset, q.local_rows));
    q.sharded = q.padded.narrow(0, 0, q.local_rows).detach().requires_grad_(q.param.requires_grad());
    q.unsharded_offset = offsets[i];
    q.unsharded = unsharded_buf_.narrow(0, offsets[i], nbytes[i]).view(q.compute_dtype).view(q.shape);
    q.param.set_data(q.unsharded);
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
    q.copy_in = gather_slot_.narrow(0, q.gather_offset, q.gather_bytes).view(q.compute_dtype).view(q.padded.sizes());
    // Rank r's rows of this parameter sit at [r, offset .. offset + bytes) of the gather buffer,
    // and at elements [r * pn, (r + 1) * pn) of the unsharded parameter, the last ones cut short.
    const auto src = rows.narrow(1, q.gather_offset, q.gather_bytes).view(q.compute_dtype);
    const auto dst = q.unsharded.view(-1);
    const int64_t full = q.full_pieces(), rest = q.last_piece();
    TORCH_INTERNAL_ASSERT(!alone() || q.gather_offset == q.unsharded_offset);
    if (!alone()) {  // alone, the gathered bytes are the unsharded parameters
      if (full > 0) q.copy_out.emplace_back(dst.narrow(0, 0, full * pn).view({full, pn}), src.narrow(0, 0, full));
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
      throw std::invalid_argument(fmt::format(
          "fully_shard({}): rank {} shards {} parameters but rank {} shards {}; every rank must "
          "wrap the same model",
          label_, comm_.rank(), count, q, counts[q].item<int64_t>()));
  if (count == 0) return;
  auto mine = at::empty({count}, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    const auto& q = params_[i];
    const std::string plan = fmt::format("{}|{}|{}|{}|{}", q.names.front(), fmt::join(q.shape, "x"),
                                         dtype_name(q.compute_dtype), dtype_name(q.grad_dtype),
                                         q.param.requires_grad());
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
        throw std::invalid_argument(fmt::format(
            "fully_shard({}): ranks {} and {} disagree on parameter '{}' (this rank: shape {}, "
            "compute dtype {}, grad dtype {}); param_dtype_override and grad_dtype must give the "
            "same answer on every rank",
            label_, comm_.rank(), q, p.names.front(), fmt::join(p.shape, "x"),
            dtype_name(p.compute_dtype), dtype_name(p.grad_dtype)));
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

void ParamGroup::accumulate_grads() {
  NoGradFromHere no_grad;
  for (auto& q : params_) {
    at::Tensor& g = q.param.mutable_grad();
    if (!g.defined()) continue;
    if (!q.grad_acc.defined() && g.scalar_type() == q.grad_dtype) {
      q.grad_acc = std::move(g);
    } else {
      no_grad();
      if (!q.grad_acc.defined())
        q.grad_acc = g.to(q.grad_dtype);
      else
        q.grad_acc.add_(g);
    }
    g = at::Tensor();
  }
}

bool ParamGroup::has_stray_grads() const {
  for (const auto& q : params_)
    if (q.param.grad().defined()) return true;
  return false;
}

void ParamGroup::reduce_grads_async() {
  accumulate_grads();
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
      if (!q.grad_acc.defined()) {
        zero_block(q.reduce_all);
        continue;
      }
      for (const auto& p : q.pack) copy_from_flat(p.dst, q.grad_acc, p.offset);
      for (auto& z : q.pad) zero_block(z);
      q.grad_acc = at::Tensor();
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
  const char* reduced = host_ ? reduce_raw_ + reduce_out_.storage_offset() * at::elementSize(reduce_dtype_) : nullptr;
  for (auto& q : params_) {
    if (q.reduce_offset < 0) continue;
    at::Tensor& g = q.sharded.mutable_grad();
    if (!q.reduce_piece.defined()) {  // a parameter with no rows anywhere
      no_grad();
      if (!g.defined()) g = at::zeros_like(q.sharded);
      continue;
    }
    if (g.defined()) {
      no_grad();
      g.add_(q.reduce_piece);
    } else if (host_ && q.sharded.scalar_type() == reduce_dtype_) {  // Note [raw copies]
      g = spare_or_new_grad(q, keep_spares);
      const int64_t es = at::elementSize(reduce_dtype_);
      std::memcpy(bytes_of(g), reduced + q.reduce_offset * es, q.local_rows * q.row_numel * es);
    } else {
      no_grad();
      g = empty_like_plain(q.sharded);
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
at::Tensor ParamGroup::spare_or_new_grad(Param& q, bool keep) {
  at::Tensor& spare = q.spare_grad;
  if (!keep) {
    spare = at::Tensor();
    return empty_like_plain(q.sharded);
  }
  if (!spare.defined() || spare.use_count() != 1 || spare.storage().use_count() != 1 ||
      spare.sizes() != q.sharded.sizes()) {
    spare = empty_like_plain(q.sharded);
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
  const at::Tensor& g = q.grad_acc;
  if (g.defined() && (g.scalar_type() != reduce_dtype_ || !g.is_contiguous() || !g.device().is_cpu())) return false;
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
    q.grad_acc = at::Tensor();
  }
  for (int64_t r = used; r < n; ++r) std::memset(dst + r * row_stride, 0, pn * es);
  return true;
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

std::vector<int64_t> ParamGroup::whole_shape(const Param& q) const {
  auto shape = q.shape;
  shape[0] *= block_count();
  return shape;
}

std::vector<ShardInfo> ParamGroup::shard_infos() const {
  std::vector<ShardInfo> out;
  for (const auto& q : params_)
    out.push_back({q.names, whole_shape(q), whole_row_offset(q), q.local_rows, q.padded_rows, q.compute_dtype,
                   q.grad_dtype});
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
      throw std::invalid_argument(fmt::format("load: parameter '{}' has shape [{}] in the state dict "
                                              "but [{}] in the model",
                                              q.names.front(), fmt::join(full[i].sizes(), ", "),
                                              fmt::join(whole, ", ")));
    q.padded.narrow(0, 0, q.local_rows).copy_(full[i].narrow(0, whole_row_offset(q), q.local_rows));
  }
}

}  // namespace fsdpp::fsdp
