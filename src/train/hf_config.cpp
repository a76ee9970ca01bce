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

namespace {

// The transformers families fsdpp reads and writes, by model_type.
struct Family {
  const char* type;
  const char* cls;
};
constexpr Family kFamilies[] = {{"llama", "LlamaForCausalLM"},     {"mistral", "MistralForCausalLM"},
                                {"qwen2", "Qwen2ForCausalLM"},     {"qwen3", "Qwen3ForCausalLM"},
                                {"mixtral", "MixtralForCausalLM"}, {"qwen3_moe", "Qwen3MoeForCausalLM"},
                                {"olmoe", "OlmoeForCausalLM"},     {"qwen2_moe", "Qwen2MoeForCausalLM"}};

const Family* family_of(const std::string& type) {
  for (const auto& f : kFamilies)
    if (type == f.type) return &f;
  return nullptr;
}

// rope_parameters (transformers 5) or rope_scaling (earlier): the type and its numbers, into `c`.
void read_rope(const json& rp, const std::string& key, const std::string& source, models::MoEConfig& c) {
  if (!rp.is_object()) refuse_field(source, key, rp, "expected an object");
  const std::string type = rp.value("rope_type", rp.value("type", std::string("default")));
  if (type != "default" && type != "linear" && type != "llama3")
    refuse_field(source, key, rp,
                 fmt::format("rope_type \"{}\": fsdpp implements \"default\", \"linear\" and \"llama3\" (not "
                             "dynamic, yarn, longrope or the others)",
                             type));
  c.rope_type = type;
  if (rp.contains("rope_theta") && rp["rope_theta"].is_number())
    c.rope_theta = rp["rope_theta"].get<double>();
  if (type == "default") return;
  const auto number = [&](const char* name, double& into, bool required) {
    if (rp.contains(name) && rp[name].is_number())
      into = rp[name].get<double>();
    else if (required)
      refuse_field(source, key, rp, fmt::format("{} is missing: rope_type \"{}\" needs it", name, type));
  };
  number("factor", c.rope_factor, true);
  if (type == "llama3") {
    number("low_freq_factor", c.rope_low_freq_factor, true);
    number("high_freq_factor", c.rope_high_freq_factor, true);
    double original = 0;
    number("original_max_position_embeddings", original, true);
    c.rope_original_max_seq_len = static_cast<int64_t>(original);
  }
}

}  // namespace

std::string export_type(const models::MoEConfig& c) {
  if (c.experts > 0)
    return c.qk_norm == "head"         ? "qwen3_moe"
           : c.qk_norm == "projection" ? "olmoe"
           : c.shared_expert_gate      ? "qwen2_moe"
                                       : "mixtral";
  return c.qk_norm == "head" ? "qwen3" : c.qkv_bias ? "qwen2" : c.sliding_window > 0 ? "mistral" : "llama";
}

json export_config(const models::MoEConfig& c, at::ScalarType dtype) {
  const bool moe = c.experts > 0;
  // The family whose class computes this model: by the q/k norms (Qwen3's per head, OLMoE's over
  // the projection), Qwen2's biases, Mistral's sliding window; else Llama and Mixtral.
  const std::string type = export_type(c);
  const std::string cls = family_of(type)->cls;
  if (moe) {
    const bool mixtral = type == "mixtral";
    const bool qwen = type == "qwen3_moe" || type == "qwen2_moe";
    if (c.dense_layers > 0 || (!qwen && (c.moe_step != 1 || !c.mlp_only_layers.empty())))
      refuse_export(c.dense_layers > 0 ? "dense_layers"
                    : c.moe_step != 1  ? "moe_step"
                                       : "mlp_only_layers",
                    fmt::format("{}'s layers are {}", cls,
                                qwen ? "dense where decoder_sparse_step and mlp_only_layers say, "
                                       "never the first ones as such"
                                     : "all MoE"));
    if (c.shared_expert != (type == "qwen2_moe"))
      refuse_export("shared_expert", c.shared_expert
                                         ? fmt::format("true without shared_expert_gate: {} has none, and "
                                                       "Qwen2-MoE's is gated",
                                                       cls)
                                         : "false with shared_expert_gate: Qwen2-MoE's is always there");
    if (c.score != "softmax")
      refuse_export("score", fmt::format("\"{}\": {} routes by softmax", c.score, cls));
    if (mixtral && !c.normalize_top_k)
      refuse_export("normalize_top_k", "false: Mixtral renormalises the top-k weights to sum to 1");
    if (c.top_k < 2 && c.normalize_top_k)
      refuse_export("top_k",
                    fmt::format("1: fsdpp weights a single expert by its softmax score, {} by 1", cls));
    if (c.routing != "dropless")
      refuse_export("routing",
                    fmt::format("\"{}\": {} computes every assignment (dropless)", c.routing, cls));
    if (c.qkv_bias && type != "qwen2_moe")
      refuse_export("qkv_bias", fmt::format("true: {}'s projections have no bias", cls));
    if (c.sliding_window > 0 && !mixtral)
      refuse_export("sliding_window", fmt::format("{}: {} has no sliding window", c.sliding_window, cls));
  } else {
    if (c.qk_norm == "projection")
      refuse_export("qk_norm",
                    "\"projection\": OLMoE's dense sibling (OLMo 2) normalises after the projection "
                    "too, but fsdpp exports it as OLMoE only");
    if (c.qk_norm == "head" && c.qkv_bias)
      refuse_export("qkv_bias", "true with qk_norm \"head\": Qwen3's attention bias is on every projection");
    if (c.sliding_window > 0 && type != "mistral")
      refuse_export("sliding_window",
                    fmt::format("{} with {}: transformers' {} has no sliding window on every "
                                "layer",
                                c.sliding_window, c.qkv_bias ? "qkv_bias" : "qk_norm", type));
  }
  json rope = {{"rope_type", c.rope_type}, {"rope_theta", c.rope_theta}};
  if (c.rope_type != "default") rope["factor"] = c.rope_factor;
  if (c.rope_type == "llama3") {
    rope["low_freq_factor"] = c.rope_low_freq_factor;
    rope["high_freq_factor"] = c.rope_high_freq_factor;
    rope["original_max_position_embeddings"] = c.rope_original_max_seq_len;
  }
  json j = {{"architectures", {cls}},
            {"model_type", type},
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
            {"rope_parameters", rope},
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
  if (c.rope_type != "default") j["rope_scaling"] = rope;  // read by transformers before 5
  if (type == "mixtral") {
    j["num_local_experts"] = c.experts;
    j["router_jitter_noise"] = 0.0;
  } else if (moe) {
    j["num_experts"] = c.experts;
    j["norm_topk_prob"] = c.normalize_top_k;
  }
  if (moe) {
    j["num_experts_per_tok"] = c.top_k;
    j["router_aux_loss_coef"] = c.aux_loss_coef;
    j["output_router_logits"] = false;
  }
  if (type == "qwen3_moe" || type == "qwen2_moe") {
    j["intermediate_size"] = c.ffn_hidden;
    j["moe_intermediate_size"] = c.expert_hidden;
    j["decoder_sparse_step"] = c.moe_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  if (type == "qwen2_moe") {
    j["shared_expert_intermediate_size"] =
        c.shared_expert_hidden > 0 ? c.shared_expert_hidden : c.expert_hidden;
    j["qkv_bias"] = c.qkv_bias;
  }
  if (type == "olmoe") j["clip_qkv"] = nullptr;
  if (type == "mixtral" || type == "mistral")
    j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json();
  if (type == "qwen2" || type == "qwen3" || type == "qwen3_moe" || type == "qwen2_moe") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.layers;
  }
  if (type == "llama" || type == "qwen3" || type == "qwen3_moe" || type == "olmoe")
    j["attention_bias"] = false;
  if (type == "llama") {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  return j;
}

std::string field_of(const std::string& key, bool moe) {
  static const std::map<std::string, std::string> common{{"vocab_size", "vocab_size"},
                                                         {"dim", "hidden_size"},
                                                         {"layers", "num_hidden_layers"},
                                                         {"heads", "num_attention_heads"},
                                                         {"kv_heads", "num_key_value_heads"},
                                                         {"max_seq_len", "max_position_embeddings"},
                                                         {"norm_eps", "rms_norm_eps"},
                                                         {"rope_theta", "rope_theta"},
                                                         {"init_std", "initializer_range"},
                                                         {"tie_embeddings", "tie_word_embeddings"},
                                                         {"head_dim", "head_dim"},
                                                         {"sliding_window", "sliding_window"}};
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
  const Family* family = family_of(type);
  if (!family)
    refuse_field(source, "model_type", j.value("model_type", json("missing")),
                 "fsdpp imports llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, qwen2_moe and olmoe "
                 "(docs/checkpoints.md)");
  const bool moe = type == "mixtral" || type == "qwen3_moe" || type == "qwen2_moe" || type == "olmoe";
  // The class transformers builds follows `architectures` where it is given: it must be this type's.
  const std::string cls = family->cls;
  if (j.contains("architectures") && !j["architectures"].is_null() &&
      !(j["architectures"].is_array() && j["architectures"].size() == 1 && j["architectures"][0] == cls))
    refuse_field(source, "architectures", j["architectures"],
                 fmt::format("model_type \"{}\" is {}, and fsdpp imports that class only", type, cls));
  const auto is_set = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  if (is_set("quantization_config"))
    refuse_field(source, "quantization_config", j["quantization_config"], "quantized weights are not read");
  if (j.value("hidden_act", json("silu")) != "silu")
    refuse_field(source, "hidden_act", j["hidden_act"], "fsdpp's feed-forward layers are SwiGLU (silu)");
  // Llama's and Qwen3's attention_bias puts a bias on the output projection too; Qwen2's q, k and v
  // projections always have one (and nothing else).
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (is_set(key) && j[key] != false)
      refuse_field(
          source, key, j[key],
          "fsdpp's projections have no bias (but Qwen2's query, key and value ones, model.qkv_bias)");
  models::MoEConfig c;
  c.rope_theta =
      type == "mixtral" || type == "qwen2" || type == "qwen3" ? 1e6 : 1e4;  // transformers' defaults
  if (is_set("rope_scaling")) read_rope(j["rope_scaling"], "rope_scaling", source, c);
  if (is_set("rope_parameters")) read_rope(j["rope_parameters"], "rope_parameters", source, c);
  if (is_set("rope_theta")) c.rope_theta = j["rope_theta"].get<double>();
  // Sliding windows: Mistral's and Mixtral's on every layer; Qwen's only past max_window_layers.
  int64_t window = 0;
  if (type == "qwen2" || type == "qwen3" || type == "qwen3_moe" || type == "qwen2_moe") {
    if (j.value("use_sliding_window", json(false)) != false)
      refuse_field(source, "use_sliding_window", j["use_sliding_window"],
                   "fsdpp's sliding window covers every layer, Qwen's only those past max_window_layers");
  } else if (is_set("sliding_window")) {
    if (type == "llama" || type == "olmoe")
      refuse_field(source, "sliding_window", j["sliding_window"], "Llama has no sliding window");
    window = required_int(j, "sliding_window", source);
  }
  if (is_set("layer_types") && j["layer_types"].is_array())
    for (const auto& t : j["layer_types"])
      if (t != "full_attention" && !(t == "sliding_attention" && window > 0))
        refuse_field(source, "layer_types", j["layer_types"], "fsdpp's layers are all alike");
  if (is_set("clip_qkv"))
    refuse_field(source, "clip_qkv", j["clip_qkv"],
                 "fsdpp does not clip the projections (OLMoE's null only)");
  for (const char* key : {"attention_dropout", "router_jitter_noise"})
    if (is_set(key) && !(j[key].is_number() && j[key].get<double>() == 0))
      refuse_field(source, key, j[key], "fsdpp implements 0 only");
  if (j.value("pretraining_tp", json(1)) != 1)
    refuse_field(source, "pretraining_tp", j["pretraining_tp"], "fsdpp implements 1 only");

  c.vocab_size = required_int(j, "vocab_size", source);
  c.dim = required_int(j, "hidden_size", source);
  c.layers = required_int(j, "num_hidden_layers", source);
  c.heads = required_int(j, "num_attention_heads", source);
  c.kv_heads = is_set("num_key_value_heads") ? required_int(j, "num_key_value_heads", source) : c.heads;
  if (c.kv_heads == c.heads) c.kv_heads = 0;
  // Qwen3's heads are 128 wide unless config.json says otherwise; the others' hidden / heads.
  const int64_t head_dim = is_set("head_dim")                       ? required_int(j, "head_dim", source)
                           : type == "qwen3" || type == "qwen3_moe" ? 128
                                                                    : 0;
  if (c.heads > 0 && head_dim > 0 && head_dim * c.heads != c.dim) c.head_size = head_dim;
  // Qwen2-MoE's attention biases follow its qkv_bias (true unless said otherwise).
  c.qkv_bias = type == "qwen2" || (type == "qwen2_moe" && j.value("qkv_bias", json(true)) != false);
  c.qk_norm = type == "qwen3" || type == "qwen3_moe" ? "head" : type == "olmoe" ? "projection" : "none";
  c.sliding_window = window;
  c.max_seq_len =
      is_set("max_position_embeddings") ? required_int(j, "max_position_embeddings", source) : 2048;
  c.norm_eps = j.value("rms_norm_eps", moe ? 1e-5 : 1e-6);
  c.init_std = j.value("initializer_range", 0.02);
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  const int64_t hidden = required_int(j, "intermediate_size", source);
  if (type == "qwen3_moe" || type == "qwen2_moe" || type == "olmoe") {
    // Softmax over every expert, the top k, their scores renormalised with norm_topk_prob; Qwen3-MoE
    // keeps dense layers (intermediate_size wide) as decoder_sparse_step and mlp_only_layers say.
    // transformers 5 writes num_local_experts for Qwen3-MoE (its attribute map's name for num_experts).
    c.experts = required_int(j, is_set("num_local_experts") ? "num_local_experts" : "num_experts", source);
    c.top_k = required_int(j, "num_experts_per_tok", source);
    c.normalize_top_k = j.value("norm_topk_prob", false) == true;
    if (c.top_k < 2 && c.normalize_top_k)
      refuse_field(source, "num_experts_per_tok", j["num_experts_per_tok"],
                   "with norm_topk_prob a single expert weighs 1, fsdpp weighs it by its softmax score");
    c.expert_hidden = type == "olmoe" ? hidden : required_int(j, "moe_intermediate_size", source);
    c.ffn_hidden = hidden;
    if (type != "olmoe") {
      c.moe_step = is_set("decoder_sparse_step") ? required_int(j, "decoder_sparse_step", source) : 1;
      if (is_set("mlp_only_layers")) c.mlp_only_layers = j["mlp_only_layers"].get<std::vector<int64_t>>();
    }
    c.dense_layers = 0;
    // Qwen2-MoE's shared expert, its output scaled by sigmoid(shared_expert_gate).
    c.shared_expert = c.shared_expert_gate = type == "qwen2_moe";
    if (c.shared_expert) c.shared_expert_hidden = required_int(j, "shared_expert_intermediate_size", source);
    c.score = "softmax";
    c.aux_loss_coef = j.value("router_aux_loss_coef", 0.001);
    c.z_loss_coef = 0;  // none computes one in its forward
  } else if (moe) {
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
