#pragma once
// The shape of an MoE transformer (models/moe.hpp), on its own so that recipes and tools can hold
// one without LibTorch's module headers.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdpp::models {

struct MoEConfig {
  int64_t vocab_size = 256;
  int64_t dim = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  // Key and value heads (grouped-query attention): each serves heads / kv_heads query heads,
  // consecutive ones (query head h reads kv head h / (heads / kv_heads)), as Llama and Mixtral
  // group them. 0: heads (multi-head attention).
  int64_t kv_heads = 0;
  // Each head's width (the recipe's "head_dim"); 0: dim / heads. Qwen3 and Mistral set it apart
  // from the hidden size: the attention then projects dim to heads x head_dim and back.
  int64_t head_size = 0;
  // Biases on the query, key and value projections (Qwen2's); the output projection has none.
  bool qkv_bias = false;
  // RMSNorm of the queries and keys before the rotary embedding: "none", "head" (Qwen3's: over each
  // head's head_dim values, one weight of head_dim for the query heads and one for the key heads),
  // or "projection" (OLMoE's: over all the queries and all the keys of a token, weights of
  // heads x head_dim and kv_heads x head_dim).
  std::string qk_norm = "none";
  // Sliding-window attention (Mistral's): each token sees itself and the sliding_window - 1
  // positions before it; 0: every earlier position.
  int64_t sliding_window = 0;
  int64_t max_seq_len = 256;
  int64_t ffn_hidden = 384;  // dense SwiGLU layers
  int64_t dense_layers = 0;  // the first N layers are dense, the rest MoE
  // And, as Qwen-MoE's decoder_sparse_step and mlp_only_layers: only every moe_step-th layer
  // (layers moe_step - 1, 2 moe_step - 1, ...) is MoE, and the layers listed are dense.
  int64_t moe_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t experts = 4;  // 0: every layer dense
  int64_t top_k = 2;
  int64_t expert_hidden = 192;
  bool shared_expert = false;
  // The shared expert's width (0: expert_hidden), and Qwen2-MoE's gate on it: its output times
  // sigmoid(x . w) for a learned w [1, dim].
  int64_t shared_expert_hidden = 0;
  bool shared_expert_gate = false;
  std::string score = "softmax";     // softmax | sigmoid
  bool normalize_top_k = true;       // top-k weights sum to 1
  std::string routing = "dropless";  // dropless | capacity
  double capacity_factor = 1.25;
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.001;
  double rope_theta = 10000.0;
  // Rotary scaling as transformers' rope_type: "default" (none); "linear" (positions divided by
  // rope_factor); "llama3" (Llama 3.1's: wavelengths past rope_original_max_seq_len /
  // rope_low_freq_factor slowed by rope_factor, those under rope_original_max_seq_len /
  // rope_high_freq_factor kept, a smooth ramp between).
  std::string rope_type = "default";
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max_seq_len = 8192;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  // The output head multiplies by the embedding's weight (one parameter, embed.weight, no
  // head.weight): tied input and output embeddings.
  bool tie_embeddings = false;
  // RMSNorm, SwiGLU's silu(a) * b, the router's softmax and top-k and dropless routing's rows as
  // single-pass kernels on the CPU (models/cpu/kernels.hpp); false: the ATen compositions, bit for bit
  // what PyTorch's eager modules compute. How the model computes, not what it is: not part of a
  // checkpoint's model description.
  bool fused_kernels = true;
  // With fused_kernels, the rotary embedding and causal attention on the CPU in one kernel
  // (models::rotary_causal_attention, float32); false: scaled_dot_product_attention, ATen's flash
  // attention there. Not part of a checkpoint's model description either.
  bool fused_attention = true;
  // bfloat16 matrix products on the CPU by MKL's bfloat16 kernel called directly (models/cpu/matmul.hpp)
  // where it beats ATen's, whose bfloat16 products set up a oneDNN primitive per call
  // (bf16_matmul_preferred()); false, or where it does not: ATen's. How, not what: not part of a
  // checkpoint's model description either.
  bool own_products = true;

  bool is_moe_layer(int64_t i) const {
    return experts > 0 && i >= dense_layers && (i + 1) % moe_step == 0 &&
           std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) == mlp_only_layers.end();
  }
  int64_t key_value_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t head_dim() const { return head_size > 0 ? head_size : dim / heads; }
  int64_t parameter_count() const;
};

}  // namespace fsdpp::models
