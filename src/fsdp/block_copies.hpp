#pragma once
// Byte-level copies between a parameter group's persistent views (Note [raw copies] in
// param_group.cpp), shared by the group's gather and gradient halves. Private to src/fsdp.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/grad_mode.h>

#include <cstring>

namespace fsdpp::fsdp::blocks {

// Copies between the persistent views are mostly same-dtype blocks of contiguous rows. For the many
// small units of a deep model, ATen's generic copy (a TensorIterator per call) costs more than the
// bytes themselves, so such blocks go through memcpy; anything else (a dtype cast) through ATen.
inline bool rows_view(const at::Tensor& t) {
  return t.device().is_cpu() && (t.dim() == 1 ? t.stride(0) == 1 || t.numel() <= 1
                                              : t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1));
}

inline bool plain_bytes(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); }

// `rows` rows of `row_bytes` bytes, one every d_stride bytes at d, from one every s_stride at s.
inline void copy_strided(char* d, int64_t d_stride, const char* s, int64_t s_stride, int64_t rows,
                         size_t row_bytes) {
  if (row_bytes == 0) return;
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * d_stride, s + r * s_stride, row_bytes);
}

// dst (a rows view) <- its rows read from s, one every s_stride bytes.
inline void copy_rows(const at::Tensor& dst, const char* s, int64_t s_stride) {
  const int64_t rows = dst.dim() == 2 ? dst.size(0) : 1;
  const size_t row_bytes = (dst.dim() == 2 ? dst.size(1) : dst.numel()) * dst.element_size();
  const int64_t ds = dst.dim() == 2 ? dst.stride(0) * dst.element_size() : 0;
  if (row_bytes > 0) copy_strided(static_cast<char*>(dst.data_ptr()), ds, s, s_stride, rows, row_bytes);
}

inline char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

inline void copy_block(const at::Tensor& dst, const at::Tensor& src) {
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
inline void copy_from_flat(const at::Tensor& dst, const at::Tensor& src, int64_t offset) {
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
inline at::Tensor empty_like_plain(const at::Tensor& t, std::optional<at::ScalarType> dtype = std::nullopt) {
  const auto d = dtype.value_or(t.scalar_type());
  if (t.device().is_cpu()) return at::detail::empty_cpu(t.sizes(), d, false, std::nullopt);
  return at::empty_like(t, at::TensorOptions().dtype(d), at::MemoryFormat::Contiguous);
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

inline void zero_block(const at::Tensor& t) {
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

}  // namespace fsdpp::fsdp::blocks
