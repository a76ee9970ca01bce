#pragma once
// Single-pass CPU kernels for the model's elementwise work, forward and backward, next to the ATen
// compositions they stand for: RMSNorm, SwiGLU's gate, the rotary embedding of q and k, the
// router's softmax and top-k, and the MoE layer's rows to and from its experts.
//
// For RMSNorm and SwiGLU the compositions take several passes over the activations each way
// (RMSNorm: square, mean, add, rsqrt and two multiplies forward, about twice as many backward, and
// a reduction for the weight's gradient; silu(a) * b: two passes forward, three backward) and keep
// intermediate results for the backward. The kernels read and write each element once per
// direction and keep only their inputs (and one float per row for RMSNorm). These two are not the
// compositions' bits: they sum in another order and take exp from a polynomial (within a few
// float32 ulps of the composition; tests/models/test_model.cpp bounds it), which is why the model
// can switch them off (MoEConfig::fused_kernels) where bitwise agreement with PyTorch's eager
// modules is the point. Each is the composition off the CPU, for float64 (which the composition
// computes as written) and, for swiglu, for anything but float32 (bfloat16's conversions cost more
// than the passes saved). Rows and elements run on ATen's intra-op threads, and the results do not
// depend on how many there are.
//
// The rotary embedding's kernel is the composition's bits (below), as are dropless routing's row
// movements around the experts (dispatch_rows, combine_rows) but for the routing weights' gradient.
//
// Causal attention's kernel computes what scaled_dot_product_attention(is_causal) computes, in
// fewer and larger matrix products than ATen's CPU flash attention (bench/results/attention.md),
// and is not its bits either (another summation order; exp from the same polynomial).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

namespace fsdpp::models {

// x * rsqrt(mean(x^2 over the last dimension) + eps) * weight, computed in float32 whatever x's
// dtype (weight: [x.size(-1)]); the result takes x's dtype, the weight's gradient the weight's.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// A pre-norm block's residual stream: {x + r, rms_norm(x + r, weight)} ({x, rms_norm(x)} with r
// undefined; r: x's shape and dtype). The kernel writes the sum and its norm in one pass, and its
// backward adds the sum's own gradient (the residual path's) into the norm's input gradient as it
// computes it, where autograd would sum the two in a separate add. In float32 the bits of x + r,
// rms_norm and autograd's sum; in bfloat16 one rounding of that sum where autograd's has two.
std::pair<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                    const at::Tensor& weight, double eps);
std::pair<at::Tensor, at::Tensor> residual_rms_norm_reference(const at::Tensor& x, const at::Tensor& r,
                                                              const at::Tensor& weight, double eps);

// silu(a) * b = a * sigmoid(a) * b, elementwise (a and b of one shape and dtype): SwiGLU's gate.
at::Tensor swiglu(const at::Tensor& a, const at::Tensor& b);
at::Tensor swiglu_reference(const at::Tensor& a, const at::Tensor& b);

// The experts' SwiGLU over rows grouped by expert (x [rows, dim] sorted by expert; w1 and w3
// [experts, hidden, dim], w2 [experts, dim, hidden]; `ends` as models::grouped_linear takes them):
// expert e's row r gives swiglu(x[r] w1[e]^T, x[r] w3[e]^T) w2[e]^T; rows past the last end are
// zero, and so is x's gradient there. Differentiable in x and the three weights. On the CPU in
// float32, where LibTorch has a BLAS, one kernel runs expert after expert, its rows in chunks of
// `chunk_rows`: a chunk's three products and gate (backward: its five products, the gate recomputed
// in one pass with its backward) before the next chunk, so that the chunk's [rows, hidden]
// intermediates stay in a core's caches, where the composition passes over every expert's rows
// between one product and the next; x's two gradient parts are summed inside the second product,
// each weight's gradient accumulated chunk by chunk, and only the first two products' outputs are
// kept for backward.
// Not the composition's bits: its products sum over another split of the rows. Chunks run on ATen's
// intra-op threads forward, experts backward, each product on one thread, so the results do not
// depend on how many there are. Elsewhere the reference: grouped_linear (ATen's grouped product)
// and swiglu. bench/results/expert_swiglu_kernel.md times both and the chunk sizes.
inline constexpr int64_t kExpertChunkRows = 128;
at::Tensor expert_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                         const at::Tensor& w2, const at::Tensor& ends, int64_t chunk_rows = kExpertChunkRows);
at::Tensor expert_swiglu_reference(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                                   const at::Tensor& w2, const at::Tensor& ends);

// The rotary embedding's frequencies: theta, and transformers' rope scaling (MoEConfig's rope_*
// fields; rope_type "default", "linear" or "llama3").
struct RopeSpec {
  double theta = 10000.0;
  std::string type = "default";
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_seq_len = 8192;
};

// cos and sin of the rotary angles of T positions, each [T, head_dim] (the head_dim / 2 angles
// position * f_j, repeated twice), given `options`' dtype. f_j = 1 / theta^(2j / head_dim), scaled as
// `rope` says (transformers' rope types of the same names), each step and the angles in float32 as
// transformers computes them.
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t head_dim, const RopeSpec& rope,
                                                at::TensorOptions options);
inline std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t head_dim, double theta,
                                                       at::TensorOptions options) {
  return rotary_tables(T, head_dim, RopeSpec{.theta = theta}, options);
}

// Packed sequences. `positions` [B, T] (int64) numbers each token from the start of its own
// sequence: a sequence starts where its position is 0, and position i - positions[b, i] is where
// token i's starts (transformers' position_ids for packed samples, as DataCollatorWithFlattening
// writes them). rotary_at gathers the tables' rows at those positions ([B, T, head_dim] each);
// sequence_starts gives each token's first visible key, i - positions (int64 [B, T]). Both on the
// positions' device, without reading them on the host.
std::pair<at::Tensor, at::Tensor> rotary_at(const std::pair<at::Tensor, at::Tensor>& tables,
                                            const at::Tensor& positions);
at::Tensor sequence_starts(const at::Tensor& positions);

// Rotary position embedding of one tensor: x * cos + rotate_half(x) * sin, written as ATen
// operations (x: [B, H, T, head_dim]; cos, sin: [T, head_dim], or [B, T, head_dim] for positions
// of their own per sample (rotary_at); rotate_half(x) = cat(-x2, x1)).
at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The attention's projection split and rotated: qkv [B, T, 3, H, head_dim] -> q', k', v, each
// [B, H, T, head_dim], q' and k' rotated by rotary_reference. On the CPU (contiguous qkv) one pass
// forward and one backward, writing the projection's gradient directly, where the composition of
// ATen operations takes about five passes for the rotation (slice, neg, cat, two multiplies and an
// add), as many again for its gradient, and three zero-filled tensors summed for the projection's.
// Each element is the same rounded float operations as there, so values and gradients are those of
// the composition bit for bit (a zero's sign aside: the composition adds zero-filled tensors);
// elsewhere it is the composition.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin);

// softmax(q k^T / sqrt(D) + causal mask) v for q, k, v [B, H, T, D] (query i sees keys 0..i), the
// result [B, H, T, D] laid out [B, T, H, D] in memory. With `starts` (int64 [B, T], sequence_starts
// of packed samples) query i of sample b sees keys starts[b, i]..i only: no attention crosses from
// one packed sequence into another, and a block of queries multiplies only the keys its rows see. On the CPU in float32 (any strides) a kernel
// of row blocks of whole heads whose products go to LibTorch's BLAS (src/models/cpu/attention.cpp), and
// differentiable in q, k and v; elsewhere, or where LibTorch has no BLAS, causal_attention_reference:
// at::scaled_dot_product_attention(q, k, v, is_causal = true).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& starts = {});
// With `starts`, scaled_dot_product_attention with a boolean [B, 1, T, T] mask.
at::Tensor causal_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& starts = {});

// causal_attention(rotary_qkv(qkv, cos, sin)): the attention's projection qkv [B, T, 3, H, head_dim]
// to the attention's output [B, H, T, head_dim], laid out [B, T, H, head_dim] in memory. On the CPU
// in float32 (contiguous qkv, contiguous float32 cos and sin) one kernel rotates each head's q and k
// into a thread's scratch as it attends, reads v in place and writes the projection's gradient
// directly: none of the [B, H, T, head_dim] tensors of q, k, v and their gradients that the two
// calls write and read again. The same operations on the same values as the two calls, which it
// is elsewhere. bfloat16 and float16 on the CPU (qkv, cos and sin of one dtype) take the float32
// kernel on their values widened, the result rounded once (Note [16-bit attention on the CPU]).
//
// Note [16-bit attention on the CPU]
// ATen's flash attention in bfloat16 multiplies each block of queries and keys through oneDNN,
// which describes and looks up a primitive and allocates its attributes for every block: with the
// weight products already on MKL's bfloat16 kernel, widening makes a bfloat16 step of moe-small
// markedly faster (bench/results/bf16_attention.md). Widening qkv and rounding the result
// are two passes over tensors the kernel reads and writes anyway. The
// kernel sums in float32 as ATen's does, and keeps its probabilities in float32 where ATen rounds
// them to bfloat16 before multiplying by v: the same function, rounded differently (less).
// cos and sin may be [B, T, head_dim] and `starts` given, for packed samples (rotary_at,
// sequence_starts).
at::Tensor rotary_causal_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& starts = {});

// Whether causal_attention has its CPU kernel in this process (LibTorch's BLAS found).
bool causal_attention_available();

// The router's softmax and top-k over each token's logits [T, E]: scores = softmax(logits), lse =
// logsumexp(logits) [T] (the z-loss's), experts [T, k] (int64) the k highest scores, weights [T, k]
// their scores, divided by their sum when `normalize`; differentiable in the logits through scores,
// lse and weights. On the CPU in float32 one pass over each row each way, exp from a polynomial
// (the same function rounded differently, within a few float32 ulps), the lower expert first among
// equal scores; elsewhere, and in the reference, ATen's softmax, topk, a division and logsumexp.
struct RouterTopK {
  at::Tensor scores, lse, weights, experts;
};
RouterTopK softmax_top_k(const at::Tensor& logits, int64_t k, bool normalize);
RouterTopK softmax_top_k_reference(const at::Tensor& logits, int64_t k, bool normalize);

// Dropless routing's rows around the experts. Token t's j-th choice is assignment a = t * k + j;
// sorted by expert (stably: ascending a within an expert), assignment order[p] is at position p.
// `position` is the inverse (assignment a sits at position[a]); on the CPU only, undefined
// elsewhere. `counts` holds each expert's rows (int64 [E]).
struct ExpertOrder {
  at::Tensor order, position, counts;
  int64_t top_k = 1;
};
// From the choices `experts` [T, k] (int64, each in [0, num_experts)): on the CPU one counting
// pass (an out-of-range choice is an error naming it), elsewhere at::sort(stable) and a scatter.
ExpertOrder sort_by_expert(const at::Tensor& experts, int64_t num_experts);

// The experts' input: the row of x [T, D] each position's assignment belongs to, [T * k, D] in
// expert order (x.index_select(0, order / k)). On the CPU in float32 the gradient of x is each
// token's k rows summed, in ascending position, into a tensor it writes once; the reference's
// (index_add's) bits, without its zero-filled tensor and its sort of the index.
at::Tensor dispatch_rows(const at::Tensor& x, const ExpertOrder& o);
at::Tensor dispatch_rows_reference(const at::Tensor& x, const ExpertOrder& o);

// The experts' output y [T * k, D] (expert order) back to the tokens, weighted by the router:
// out[t] = sum over t's choices j of weights[t, j] * y[position[t * k + j]], summed from zero in
// ascending position as index_add sums ([T, D]; weights [T, k]). On the CPU in float32 one pass
// each way: the values and y's gradient are the reference's bits; the weights' gradient, each a
// dot product over D, is summed in another order than ATen's reduction (a few float32 ulps apart).
// The reference is what the model computed before: index_select, a multiply and index_add into
// zeros, about four passes over [T * k, D] forward and five backward.
at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& weights, const ExpertOrder& o);
at::Tensor combine_rows_reference(const at::Tensor& y, const at::Tensor& weights, const ExpertOrder& o);

}  // namespace fsdpp::models
