#pragma once
// The shape of an MoE transformer (models/moe.hpp), on its own so that recipes and tools can hold
// one without LibTorch's module headers.

#include <cstdint>
#include <string>

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
  int64_t max_seq_len = 256;
  int64_t ffn_hidden = 384;  // dense SwiGLU layers
  int64_t dense_layers = 0;  // the first N layers are dense, the rest MoE
  int64_t experts = 4;       // 0: every layer dense
  int64_t top_k = 2;
  int64_t expert_hidden = 192;
  bool shared_expert = false;
  std::string score = "softmax";     // softmax | sigmoid
  bool normalize_top_k = true;       // top-k weights sum to 1
  std::string routing = "dropless";  // dropless | capacity
  double capacity_factor = 1.25;
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.001;
  double rope_theta = 10000.0;
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

  bool is_moe_layer(int64_t i) const { return experts > 0 && i >= dense_layers; }
  int64_t key_value_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t head_dim() const { return dim / heads; }
  int64_t parameter_count() const;
};

}  // namespace fsdpp::models
