// Transformers' config.json from fsdpp's model config and back (train/hf.hpp).
#include <ATen/core/Tensor.h>
#include <fmt/format.h>

#include <map>
#include <stdexcept>
#include <string>

#include "fsdpp/train/hf.hpp"
#include "fsdpp/train/recipe.hpp"

namespace fsdpp::train::hf {

using nlohmann::json;

namespace {

[[noreturn]] void refuse_export(const std::string& key, const std::string& why) {
  throw std::invalid_argument(fmt::format("export --format hf: model.{}: {}", key, why));
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      throw std::invalid_argument(
          fmt::format("export --format hf: dtype {} is not float32, bfloat16 or float16", c10::toString(t)));
  }
}

// A field of a transformers config that fsdpp does not implement, when it is set to something
// other than what fsdpp computes.
[[noreturn]] void refuse_field(const std::string& source, const std::string& key, const json& value,
                               const std::string& why) {
  throw std::invalid_argument(fmt::format("{}: {} {}: {}", source, key, value.dump(), why));
}

int64_t required_int(const json& j, const std::string& key, const std::string& source) {
  if (!j.contains(key) || !j[key].is_number_integer())
    throw std::invalid_argument(fmt::format("{}: {} is {}; it must be an integer", source, key,
                                            j.contains(key) ? j[key].dump() : "missing"));
  return j[key].get<int64_t>();
}

}  // namespace

json export_config(const models::MoEConfig& c, at::ScalarType dtype) {
  const bool moe = c.experts > 0;
  if (moe) {
    if (c.dense_layers > 0)
      refuse_export("dense_layers", fmt::format("{}: Mixtral's layers are all MoE, and no transformers class "
                                                "computes dense first layers with fsdpp's experts exactly",
                                                c.dense_layers));
    if (c.shared_expert)
      refuse_export("shared_expert", "true: Mixtral has no shared expert, and Qwen2-MoE's is gated");
    if (c.score != "softmax")
      refuse_export("score", fmt::format("\"{}\": Mixtral routes by softmax", c.score));
    if (!c.normalize_top_k)
      refuse_export("normalize_top_k", "false: Mixtral renormalises the top-k weights to sum to 1");
    if (c.top_k < 2)
      refuse_export("top_k", "1: fsdpp weights a single expert by its softmax score, Mixtral by 1");
    if (c.routing != "dropless")
      refuse_export("routing",
                    fmt::format("\"{}\": Mixtral computes every assignment (dropless)", c.routing));
  }
  json j = {{"architectures", {moe ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
            {"model_type", moe ? "mixtral" : "llama"},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.dim},
            {"intermediate_size", moe ? c.expert_hidden : c.ffn_hidden},
            {"num_hidden_layers", c.layers},
            {"num_attention_heads", c.heads},
            {"num_key_value_heads", c.key_value_heads()},
            {"head_dim", c.head_dim()},
            {"hidden_act", "silu"},
            {"max_position_embeddings", c.max_seq_len},
            {"rms_norm_eps", c.norm_eps},
            {"rope_theta", c.rope_theta},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
            {"attention_dropout", 0.0},
            {"initializer_range", c.init_std},
            {"tie_word_embeddings", c.tie_embeddings},
            // No special tokens: the bytes tokenizer has none, and a generation would otherwise
            // stop at transformers' default end-of-text id.
            {"bos_token_id", nullptr},
            {"eos_token_id", nullptr},
            {"pad_token_id", nullptr},
            {"use_cache", true},
            {"dtype", dtype_name(dtype)}};
  if (moe) {
    j["num_local_experts"] = c.experts;
    j["num_experts_per_tok"] = c.top_k;
    j["router_aux_loss_coef"] = c.aux_loss_coef;
    j["router_jitter_noise"] = 0.0;
    j["output_router_logits"] = false;
    j["sliding_window"] = nullptr;
  } else {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  return j;
}

std::string field_of(const std::string& key, bool moe) {
  static const std::map<std::string, std::string> common{
      {"vocab_size", "vocab_size"},        {"dim", "hidden_size"},
      {"layers", "num_hidden_layers"},     {"heads", "num_attention_heads"},
      {"kv_heads", "num_key_value_heads"}, {"max_seq_len", "max_position_embeddings"},
      {"norm_eps", "rms_norm_eps"},        {"rope_theta", "rope_theta"},
      {"init_std", "initializer_range"},   {"tie_embeddings", "tie_word_embeddings"}};
  static const std::map<std::string, std::string> mixtral{{"experts", "num_local_experts"},
                                                          {"top_k", "num_experts_per_tok"},
                                                          {"expert_hidden", "intermediate_size"},
                                                          {"aux_loss_coef", "router_aux_loss_coef"}};
  static const std::map<std::string, std::string> llama{{"ffn_hidden", "intermediate_size"}};
  for (const auto* m : {&common, moe ? &mixtral : &llama})
    if (const auto it = m->find(key); it != m->end()) return it->second;
  return "";
}

models::MoEConfig import_config(const json& j, const std::string& source) {
  if (!j.is_object()) throw std::invalid_argument(fmt::format("{}: not a JSON object", source));
  const std::string type =
      j.value("model_type", json("missing")).is_string() ? j.value("model_type", "") : "";
  if (type != "llama" && type != "mixtral")
    refuse_field(source, "model_type", j.value("model_type", json("missing")),
                 "fsdpp imports llama (LlamaForCausalLM) and mixtral (MixtralForCausalLM)");
  const bool moe = type == "mixtral";
  // The class transformers builds follows `architectures` where it is given: it must be this type's.
  const std::string cls = moe ? "MixtralForCausalLM" : "LlamaForCausalLM";
  if (j.contains("architectures") && !j["architectures"].is_null() &&
      !(j["architectures"].is_array() && j["architectures"].size() == 1 && j["architectures"][0] == cls))
    refuse_field(source, "architectures", j["architectures"],
                 fmt::format("model_type \"{}\" is {}, and fsdpp imports that class only", type, cls));
  const auto is_set = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  if (is_set("quantization_config"))
    refuse_field(source, "quantization_config", j["quantization_config"], "quantized weights are not read");
  if (j.value("hidden_act", json("silu")) != "silu")
    refuse_field(source, "hidden_act", j["hidden_act"], "fsdpp's feed-forward layers are SwiGLU (silu)");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (j.value(key, json(false)) != false)
      refuse_field(source, key, j[key], "fsdpp's projections have no bias");
  if (is_set("rope_scaling") &&
      (!j["rope_scaling"].is_object() ||
       j["rope_scaling"].value("rope_type", j["rope_scaling"].value("type", "")) != "default"))
    refuse_field(source, "rope_scaling", j["rope_scaling"],
                 "fsdpp's rotary embedding is unscaled (\"default\")");
  double theta = moe ? 1e6 : 1e4;  // transformers' defaults
  if (is_set("rope_parameters")) {
    const auto& rp = j["rope_parameters"];
    if (!rp.is_object() || rp.value("rope_type", "default") != "default")
      refuse_field(source, "rope_parameters", rp,
                   "fsdpp's rotary embedding is unscaled (rope_type \"default\")");
    if (rp.contains("rope_theta")) theta = rp["rope_theta"].get<double>();
  }
  if (is_set("rope_theta")) theta = j["rope_theta"].get<double>();
  if (is_set("sliding_window"))
    refuse_field(source, "sliding_window", j["sliding_window"],
                 "fsdpp's attention sees every earlier position");
  for (const char* key : {"attention_dropout", "router_jitter_noise"})
    if (is_set(key) && !(j[key].is_number() && j[key].get<double>() == 0))
      refuse_field(source, key, j[key], "fsdpp implements 0 only");
  if (j.value("pretraining_tp", json(1)) != 1)
    refuse_field(source, "pretraining_tp", j["pretraining_tp"], "fsdpp implements 1 only");

  models::MoEConfig c;
  c.vocab_size = required_int(j, "vocab_size", source);
  c.dim = required_int(j, "hidden_size", source);
  c.layers = required_int(j, "num_hidden_layers", source);
  c.heads = required_int(j, "num_attention_heads", source);
  c.kv_heads = is_set("num_key_value_heads") ? required_int(j, "num_key_value_heads", source) : c.heads;
  if (c.kv_heads == c.heads) c.kv_heads = 0;
  if (is_set("head_dim") && c.heads > 0 && required_int(j, "head_dim", source) * c.heads != c.dim)
    refuse_field(
        source, "head_dim", j["head_dim"],
        fmt::format("fsdpp's heads are hidden_size / num_attention_heads = {} wide", c.dim / c.heads));
  c.max_seq_len =
      is_set("max_position_embeddings") ? required_int(j, "max_position_embeddings", source) : 2048;
  c.norm_eps = j.value("rms_norm_eps", moe ? 1e-5 : 1e-6);
  c.rope_theta = theta;
  c.init_std = j.value("initializer_range", 0.02);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  const int64_t hidden = required_int(j, "intermediate_size", source);
  if (moe) {
    c.experts = required_int(j, "num_local_experts", source);
    c.top_k = required_int(j, "num_experts_per_tok", source);
    if (c.top_k < 2)
      refuse_field(source, "num_experts_per_tok", j["num_experts_per_tok"],
                   "fsdpp weights a single expert by its softmax score, Mixtral by 1");
    c.expert_hidden = hidden;
    c.dense_layers = 0;
    c.shared_expert = false;
    c.score = "softmax";
    c.normalize_top_k = true;
    c.aux_loss_coef = j.value("router_aux_loss_coef", 0.001);
    c.z_loss_coef = 0;  // Mixtral has none
  } else {
    c.experts = 0;
    c.ffn_hidden = hidden;
  }
  // fsdpp's own checks (heads that split the width evenly, ranges), each problem named by the
  // file's own field.
  try {
    return parse_model_config(to_json(c), source);
  } catch (const RecipeError& e) {
    std::vector<std::string> problems;
    for (auto p : e.problems()) {
      const auto colon = p.find(':');
      if (const auto field = field_of(p.substr(0, colon), moe); colon != std::string::npos && !field.empty())
        p = field + p.substr(colon);
      problems.push_back(p);
    }
    throw RecipeError(source, problems);
  }
}

}  // namespace fsdpp::train::hf
