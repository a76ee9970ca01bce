#pragma once
// A decoder-only mixture-of-experts language model, usable on its own or through the trainer.
//
//   tokens -> embed -> [Block] x layers -> norm -> head -> logits
//   Block:  x + attn(attn_norm(x));  x + ffn(ffn_norm(x))
//   attn:   causal self-attention with rotary position embeddings (RoPE)
//   ffn:    dense SwiGLU ("mlp") or mixture of experts ("moe"): a router gate scores the experts
//           (softmax or sigmoid), each token goes to its top-k, E SwiGLU experts stored as stacked
//           [E, ...] tensors, plus an optional shared expert every token passes through.
//
// Parameter names read naturally for per-parameter policies, for example
//   embed.weight, layers.3.attn.qkv.weight, layers.3.moe.router.gate.weight,
//   layers.3.moe.experts.w1 (E x hidden x dim), layers.3.ffn_norm.weight, norm.weight, head.weight
// so "*.router.gate.weight" and "*norm*" select the router gates and the norms.
//
// Routing modes:
//   dropless  every (token, expert) assignment is computed; expert batch sizes vary with the data.
//   capacity  each expert takes at most C = ceil(capacity_factor * tokens * top_k / E) assignments
//             in token order; the rest are dropped (the token keeps its residual). Shapes are static,
//             which CUDA graphs need.
//
// Expert parallelism (set_expert_parallel): each rank of an `ep` communicator keeps E / ep of every
// MoE layer's experts (rank r: experts [r E/ep, (r+1) E/ep)). Routing stays local; the routed rows
// travel to their expert's rank by all-to-all and come back by the inverse all-to-all, in the same
// order, with gradients flowing back through both:
//   dropless  per-expert counts are exchanged first (one small all-to-all, read on the host), then
//             the rows in variable-sized pieces; a rank computes each of its experts on the rows
//             of every sender at once (rows regrouped by expert, then put back).
//   capacity  each rank's [E, C, dim] slot buffer is exchanged in equal pieces, so shapes stay
//             static: a rank computes [E/ep, ep x C, dim]. Every rank of `ep` must then route as
//             many tokens per forward (the trainer's microbatches are equal).
// Tokens and drops are decided per rank exactly as without expert parallelism, so the results
// are the same. Every rank of `ep` must run the same layers in the same order (they do: the ranks
// of one data-parallel step run the same program).
//
// Auxiliary losses (load balancing, Switch/GShard form: E * sum_e f_e * P_e, and the router z-loss:
// mean logsumexp(logits)^2) are applied where they arise: each MoE layer attaches them to its output
// with an identity whose backward also feeds the losses their gradient, coefficient times
// aux_grad_scale(). That is what makes them work unchanged under pipeline stages, where no single
// loss sees the whole model. Their values, and the dropped-token rate, accumulate in RouterStats.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdpp/models/token_exchange.hpp"
#include "fsdpp/models/config.hpp"
#include "fsdpp/models/cpu/kernels.hpp"

namespace fsdpp::models {

// Shared by the MoE layers of one model.
struct RouterStats {
  double aux_grad_scale = 1.0;  // multiplies the auxiliary losses' gradients (1 / microbatches)
  // Sums since the last reset(), over the MoE layers and forwards, kept on the device (float64:
  // aux loss, z-loss, dropped assignments, assignments, forwards) so that a step never reads a
  // device value on the host, and a captured step replays them; read() does that once, after it.
  at::Tensor sums;
  struct Values {
    double aux_loss = 0, z_loss = 0;
    int64_t dropped = 0, assignments = 0, forwards = 0;
  };
  // `aux_z_dropped`: 3 float64 values of one forward that routed `assigned` token-expert pairs.
  void add(const at::Tensor& aux_z_dropped, int64_t assigned);
  void reset();
  Values read() const;
  double dropped_fraction() const;
};

// `fused`: models::rms_norm's single-pass kernel, else the composition (see models/cpu/kernels.hpp).
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps, bool fused = true);
  at::Tensor forward(const at::Tensor& x);
  // {x + r, forward(x + r)} ({x, forward(x)} with r undefined): models::residual_rms_norm, whose
  // backward takes the residual stream's gradient into the norm's (the composition unfused).
  std::pair<at::Tensor, at::Tensor> forward_residual(const at::Tensor& x, const at::Tensor& r);
  at::Tensor weight;
  double eps;
  bool fused;
};
TORCH_MODULE(RMSNorm);

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const MoEConfig& c);
  // `positions` (int64 [B, T], or undefined: each sample one sequence from position 0): packed
  // samples, each token's position in its own sequence; no token attends across two sequences
  // (models::rotary_at, models::sequence_starts).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions = {});
  // x's queries, keys and values before the rotary embedding: [B, T, heads + 2 kv_heads, head_dim],
  // the query heads first, then the key heads, then the value heads; the projection's bias and the
  // q/k norms applied (what forward and KVCache share).
  at::Tensor project(const at::Tensor& x);
  int64_t heads, kv_heads, head_dim;
  int64_t sliding_window;  // MoEConfig::sliding_window
  RopeSpec rope;
  bool own_products;  // models::linear's own routes where they beat ATen's (MoEConfig::own_products)
  bool fused;         // models::rotary_causal_attention's kernel, else scaled_dot_product_attention
  torch::nn::Linear qkv{nullptr}, out{nullptr};  // qkv has a bias with MoEConfig::qkv_bias
  RMSNorm q_norm{nullptr}, k_norm{nullptr};      // MoEConfig::qk_norm "head" or "projection"
  bool norm_whole_projection = false;            // qk_norm "projection"

 private:
  // cos and sin of the rotary angles of T positions ([T, head_dim] each) in `like`'s dtype and on its
  // device: computed on the first call of each shape and kept, since they depend on nothing else.
  const std::pair<at::Tensor, at::Tensor>& rope_tables(int64_t T, int64_t head_dim, const at::Tensor& like);
  std::pair<at::Tensor, at::Tensor> tables_;
};
TORCH_MODULE(Attention);

struct SwiGLUImpl : torch::nn::Module {
  SwiGLUImpl(int64_t dim, int64_t hidden, bool fused = true, bool own_products = true);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear w1{nullptr}, w3{nullptr}, w2{nullptr};
  bool fused;         // silu(w1 x) * w3 x by models::swiglu's kernel, else the composition
  bool own_products;  // models::linear's own routes where they beat ATen's (MoEConfig::own_products)
};
TORCH_MODULE(SwiGLU);

// E SwiGLU experts as stacked tensors: w1, w3 are [E, hidden, dim], w2 is [E, dim, hidden]. Under
// expert parallelism E is this rank's share of the layer's experts.
struct ExpertsImpl : torch::nn::Module {
  ExpertsImpl(int64_t experts, int64_t dim, int64_t hidden, bool fused = true, bool own_products = true);
  // One expert on the rows routed to it.
  at::Tensor forward_one(int64_t e, const at::Tensor& x);
  // Every expert on its [capacity, dim] slot block: x is [E, C, dim].
  at::Tensor forward_batched(const at::Tensor& x);
  // With `offsets` (int32 [E], cumulative row counts): x is [rows, dim] sorted by expert, expert e
  // taking rows [offsets[e-1], offsets[e]); on the CPU one grouped product per weight
  // (models::grouped_linear) where an own product route is taken, else models::expert_swiglu's
  // kernel (with `fused`) or the grouped products by ATen; elsewhere one expert after another (the
  // offsets read on the host). Without: forward_batched(x).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& offsets);
  int64_t count() const { return w1.size(0); }
  at::Tensor w1, w3, w2;
  bool fused;         // the fused kernels (models::expert_swiglu, models::swiglu), else the composition
  bool own_products;  // models::grouped_linear's own routes where they beat ATen's (MoEConfig::own_products)
};
TORCH_MODULE(Experts);

struct RouterImpl : torch::nn::Module {
  RouterImpl(int64_t dim, int64_t experts);
  at::Tensor forward(const at::Tensor& x) { return gate(x); }
  torch::nn::Linear gate{nullptr};
};
TORCH_MODULE(Router);

// What the router decided for a [tokens, dim] input.
struct Routing {
  at::Tensor logits;    // [T, E], float32
  at::Tensor scores;    // [T, E], float32 (softmax or sigmoid of logits)
  at::Tensor weights;   // [T, k], float32, the combine weights
  at::Tensor experts;   // [T, k], int64
  at::Tensor aux_loss;  // scalar: E * sum_e f_e * P_e
  at::Tensor z_loss;    // scalar: mean over tokens of logsumexp(logits)^2
};

struct MoEImpl : torch::nn::Module {
  MoEImpl(const MoEConfig& c, std::shared_ptr<RouterStats> stats);
  at::Tensor forward(const at::Tensor& x);
  Routing route(const at::Tensor& flat) const;
  // Keeps this rank's E / ep experts and exchanges rows over `ep` (the top of this file).
  void set_expert_parallel(std::shared_ptr<TokenExchange> ep);
  const std::shared_ptr<TokenExchange>& expert_parallel() const { return ep_; }
  // Calls the experts through `wrapper` (a module around them whose forward takes and returns what
  // ExpertsImpl::forward does, such as an fsdp::FullyShard unit), also under the name "experts".
  void wrap_experts(torch::nn::AnyModule wrapper);

  MoEConfig config;
  std::shared_ptr<RouterStats> stats;
  Router router{nullptr};
  Experts experts{nullptr};
  SwiGLU shared{nullptr};
  torch::nn::Linear shared_gate{nullptr};  // MoEConfig::shared_expert_gate

 private:
  // The experts on rows sorted by expert (`counts`: int64 [E] on the device), or on the [E, C, dim]
  // slot buffer (counts undefined); across the ep ranks when there are several.
  at::Tensor run_experts(const at::Tensor& rows, const at::Tensor& counts);
  at::Tensor call_experts(const at::Tensor& x, const at::Tensor& offsets);
  torch::nn::AnyModule experts_call_;  // empty: experts itself
  std::shared_ptr<TokenExchange> ep_;  // null: every expert here
};
TORCH_MODULE(MoE);

struct BlockImpl : torch::nn::Module {
  BlockImpl(const MoEConfig& c, int64_t index, std::shared_ptr<RouterStats> stats);
  // `positions`: AttentionImpl::forward's (undefined for unpacked samples). Wrappers of a block
  // (wrap_blocks) take and pass on both.
  at::Tensor forward(at::Tensor x, at::Tensor positions);
  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  Attention attn{nullptr};
  SwiGLU mlp{nullptr};
  MoE moe{nullptr};
};
TORCH_MODULE(Block);

// The whole model, or a pipeline stage of it: layers [first, last), with the embedding when
// first == 0 and the final norm and head when last == layers. A stage takes its modules from a
// full model (same tensors, same names), so stages of one model start from identical weights.
// The model is a plain LibTorch module; a caller that shards it wraps each block first
// (wrap_blocks; train/sharding.hpp does that with fsdp::FullyShard units).
// kUnallocated: every parameter keeps its shape and dtype but no bytes (Note [unallocated
// parameters] in base/storage.hpp), each freed as soon as its part of the model is built, so a model
// larger than memory can be built, sharded by fully_shard and loaded by rows. The model's own
// initialization draws nothing then (LibTorch's Linear and Embedding still initialize themselves).
enum class Weights { kRandom, kUnallocated };

class MoETransformerImpl : public torch::nn::Module {
 public:
  explicit MoETransformerImpl(const MoEConfig& c, Weights weights = Weights::kRandom);
  MoETransformerImpl(const MoETransformerImpl& full, int64_t first, int64_t last);

  // tokens [B, T] (int64) when this holds the embedding, else hidden states [B, T, dim];
  // returns logits [B, T, vocab] (float32) when it holds the head, else hidden states.
  at::Tensor forward(const at::Tensor& input);

  // Packed samples: the positions (int64 [B, T], AttentionImpl::forward's) of the tokens of the
  // forwards that follow, until set again; undefined (the default) for one sequence per sample.
  // A setting rather than an argument, so that forward keeps the one-tensor signature that
  // fully_shard, pipeline stages and users' code call.
  void set_positions(at::Tensor positions) { positions_ = std::move(positions); }
  const at::Tensor& positions() const { return positions_; }

  const MoEConfig& config() const { return config_; }
  RouterStats& router_stats() { return *stats_; }
  bool has_embedding() const { return first_ == 0; }
  bool has_head() const { return last_ == config_.layers; }
  int64_t first_layer() const { return first_; }
  int64_t last_layer() const { return last_; }
  // The head's weight [vocab, dim]: head.weight, or embed.weight with tied embeddings.
  const at::Tensor& output_weight() const { return head ? head->weight : embed->weight; }

  // The blocks this holds, in layer order: the modules themselves, also after wrap_blocks.
  const std::vector<Block>& blocks() const { return blocks_; }
  // Replaces each block, where forward calls it and under its name in `layers`, by
  // wrap(block, layer index in the full model):
  // a module around it (an FSDP unit, activation checkpointing) whose forward takes the hidden
  // states and the positions (BlockImpl::forward) and returns the hidden states. Parameter names do not change when the wrapper adopts the block's
  // parameters under their own names, as fsdp::FullyShard does. Stages are cut from an unwrapped
  // model.
  void wrap_blocks(const std::function<torch::nn::AnyModule(const Block&, int64_t layer)>& wrap);
  // Expert parallelism for every MoE layer (MoEImpl::set_expert_parallel); call on a full model
  // before cutting stages or wrapping. Throws when ep does not divide the experts.
  void set_expert_parallel(const std::shared_ptr<TokenExchange>& ep);

  torch::nn::Embedding embed{nullptr};
  std::shared_ptr<torch::nn::Module> layers;  // children named by global layer index
  RMSNorm norm{nullptr};
  torch::nn::Linear head{nullptr};  // null with tied embeddings

 private:
  std::vector<Block> blocks_;
  std::vector<torch::nn::AnyModule> calls_;  // what forward calls: the blocks, or their wrappers
  bool wrapped_ = false;
  MoEConfig config_;
  std::shared_ptr<RouterStats> stats_;
  int64_t first_ = 0, last_ = 0;
  at::Tensor positions_;
};
TORCH_MODULE(MoETransformer);

// Mean next-token cross entropy (nats per token): logits [B, T, V], targets [B, T].
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets);
// The sum over the targets that are not -100 (transformers' ignored labels) of the same loss.
at::Tensor summed_lm_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace fsdpp::models
