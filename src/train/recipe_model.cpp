// The recipe's model section: the architecture's keys and their checks, and a transformers
// checkpoint's architecture (model.init_from DIR) against the keys a recipe gives.
#include <filesystem>
#include <optional>
#include <set>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"
#include "fsdpp/train/hf.hpp"
#include "recipe_reader.hpp"

namespace fsdpp::train::recipe_detail {

namespace fs = std::filesystem;

void read_model(Reader& r, models::MoEConfig& c) {
  r.integer("vocab_size", c.vocab_size, 2, 1 << 20);
  r.integer("dim", c.dim, 2, 1 << 16);
  r.integer("layers", c.layers, 1, 1024);
  r.integer("heads", c.heads, 1, 1024);
  r.integer("kv_heads", c.kv_heads, 0, 1024);
  r.integer("head_dim", c.head_size, 0, 1 << 12);
  r.boolean("qkv_bias", c.qkv_bias);
  r.string("qk_norm", c.qk_norm, {"none", "head", "projection"});
  r.integer("sliding_window", c.sliding_window, 0, 1 << 20);
  r.integer("max_seq_len", c.max_seq_len, 1, 1 << 20);
  r.integer("ffn_hidden", c.ffn_hidden, 1, 1 << 20);
  r.integer("dense_layers", c.dense_layers, 0, 1024);
  r.integer("moe_step", c.moe_step, 1, 1024);
  r.integers("mlp_only_layers", c.mlp_only_layers, 0, 1023);
  r.integer("experts", c.experts, 0, 4096);
  r.integer("top_k", c.top_k, 1, 4096);
  r.integer("expert_hidden", c.expert_hidden, 1, 1 << 20);
  r.boolean("shared_expert", c.shared_expert);
  r.integer("shared_expert_hidden", c.shared_expert_hidden, 0, 1 << 20);
  r.boolean("shared_expert_gate", c.shared_expert_gate);
  if (!c.shared_expert && (c.shared_expert_hidden > 0 || c.shared_expert_gate))
    r.fail(c.shared_expert_gate ? "shared_expert_gate" : "shared_expert_hidden",
           "shapes the shared expert: set shared_expert: true");
  r.string("score", c.score, {"softmax", "sigmoid"});
  r.boolean("normalize_top_k", c.normalize_top_k);
  r.string("routing", c.routing, {"dropless", "capacity"});
  r.number("capacity_factor", c.capacity_factor, 0, 1e6, /*lo_open=*/true);
  r.number("aux_loss_coef", c.aux_loss_coef, 0, 1e6);
  r.number("z_loss_coef", c.z_loss_coef, 0, 1e6);
  r.number("rope_theta", c.rope_theta, 0, 1e12, true);
  r.string("rope_type", c.rope_type, {"default", "linear", "llama3"});
  r.number("rope_factor", c.rope_factor, 0, 1e6, true);
  r.number("rope_low_freq_factor", c.rope_low_freq_factor, 0, 1e6, true);
  r.number("rope_high_freq_factor", c.rope_high_freq_factor, 0, 1e6, true);
  r.integer("rope_original_max_seq_len", c.rope_original_max_seq_len, 1, 1 << 24);
  if (c.rope_type == "llama3" && c.rope_high_freq_factor <= c.rope_low_freq_factor)
    r.fail("rope_high_freq_factor", fmt::format("must exceed rope_low_freq_factor ({}), got {}",
                                                c.rope_low_freq_factor, c.rope_high_freq_factor));
  r.number("norm_eps", c.norm_eps, 0, 1, true);
  r.number("init_std", c.init_std, 0, 10, true);
  r.boolean("tie_embeddings", c.tie_embeddings);
  r.boolean("fused_kernels", c.fused_kernels);
  r.boolean("fused_attention", c.fused_attention);
  r.boolean("own_products", c.own_products);
  if (c.head_size > 0 && c.head_size % 2 != 0)
    r.fail("head_dim", fmt::format("must be even (rotary embeddings rotate pairs), got {}", c.head_size));
  else if (c.head_size == 0 && (c.dim % c.heads != 0 || (c.dim / c.heads) % 2 != 0))
    r.fail("heads",
           fmt::format("dim {} must split into {} heads of even size (rotary embeddings rotate pairs), or "
                       "head_dim give their width",
                       c.dim, c.heads));
  if (c.kv_heads > 0 && c.heads % c.kv_heads != 0)
    r.fail("kv_heads", fmt::format("must divide heads ({}), got {}", c.heads, c.kv_heads));
  if (c.experts > 0 && c.top_k > c.experts)
    r.fail("top_k", fmt::format("must be at most experts ({}), got {}", c.experts, c.top_k));
  if (c.dense_layers > c.layers)
    r.fail("dense_layers", fmt::format("must be at most layers ({}), got {}", c.layers, c.dense_layers));
}

void read_model_section(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  if (!top.find("model")) top.fail("model", "missing: a model config path or object");
  Reader m = top.section("model");
  m.string("init_from", rc.init_from);
  std::optional<models::MoEConfig> imported;  // the architecture of a transformers checkpoint
  if (!rc.init_from.empty()) {
    rc.init_from = resolve(rc.init_from, base_dir);
    std::error_code ec;
    if (hf::is_checkpoint_dir(rc.init_from)) {
      const auto config = (fs::path(rc.init_from) / "config.json").string();
      try {
        imported = hf::import_config(fsdpp::read_json_file(config), config);
      } catch (const std::exception& e) {
        m.fail("init_from", e.what());
      }
    } else if (!fs::is_regular_file(rc.init_from, ec)) {
      m.fail("init_from", fmt::format("{} is neither a file (a safetensors file of full weights) nor a "
                                      "transformers checkpoint directory (with config.json)",
                                      rc.init_from));
    }
  }
  read_model(m, rc.model);
  if (!imported) return;
  // The checkpoint decides the architecture: a key the recipe gives must agree with it. How to train
  // (auxiliary losses, routing, the sequence limit) and how to compute stay the recipe's.
  const json theirs = to_json(*imported), given = to_json(rc.model);
  const bool moe = imported->experts > 0;
  json merged = theirs;
  // A MoE checkpoint's dense width counts where it has dense layers (Qwen-MoE's mlp_only_layers).
  bool dense = false;
  for (int64_t i = 0; i < imported->layers; ++i) dense |= !imported->is_moe_layer(i);
  for (const auto& [key, value] : theirs.items()) {
    if (!m.find(key)) continue;
    static const std::set<std::string> training{"aux_loss_coef", "z_loss_coef",     "init_std",
                                                "routing",       "capacity_factor", "max_seq_len"};
    // What the architecture leaves unused: a Mixtral's dense width, a Llama's experts' settings.
    static const std::set<std::string> moe_only{
        "expert_hidden", "top_k",    "score",           "normalize_top_k",      "shared_expert",
        "dense_layers",  "moe_step", "mlp_only_layers", "shared_expert_hidden", "shared_expert_gate"};
    const bool unused = moe ? key == "ffn_hidden" && !dense : moe_only.count(key) > 0;
    const auto field = hf::field_of(key, moe);
    if (training.count(key) || unused)
      merged[key] = given[key];
    else if (given.value(key, json()) != value)
      m.fail(key, field.empty()
                      ? fmt::format("{} here, but a {} checkpoint such as {} has {}",
                                    given.value(key, json()).dump(), moe ? "Mixtral" : "Llama", rc.init_from,
                                    value.dump())
                      : fmt::format("{} here, but the transformers checkpoint {} has {} {}",
                                    given.value(key, json()).dump(), rc.init_from, field, value.dump()));
  }
  // Keys written only when set (to_json): the checkpoint's model has none of these.
  for (const char* key :
       {"kv_heads", "tie_embeddings", "head_dim", "qkv_bias", "qk_norm", "sliding_window", "moe_step",
        "mlp_only_layers", "shared_expert_hidden", "shared_expert_gate", "rope_type", "rope_factor",
        "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"})
    if (m.find(key) && !theirs.contains(key) && given.contains(key))
      m.fail(key, fmt::format("{} here, but the transformers checkpoint {} has none", given[key].dump(),
                              rc.init_from));
  const auto how = rc.model;
  rc.model = parse_model_config(merged, rc.init_from);
  rc.model.fused_kernels = how.fused_kernels;
  rc.model.fused_attention = how.fused_attention;
  rc.model.own_products = how.own_products;
}

}  // namespace fsdpp::train::recipe_detail
