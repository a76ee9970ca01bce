#include "fsdpp/models/moe.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/init.h>

#include <cmath>
#include <tuple>

#include "fsdpp/base/storage.hpp"
#include "fsdpp/models/cpu/kernels.hpp"
#include "fsdpp/models/cpu/matmul.hpp"
#include "init_weights.hpp"

namespace fsdpp::models {

using detail::building_unallocated;
using detail::init_normal;

namespace {

// Identity on x whose backward also gives `aux` the gradient `scale`: the auxiliary losses join
// the training loss wherever the layer runs (see the top of moe.hpp).
struct AttachAuxLoss : torch::autograd::Function<AttachAuxLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor aux,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["aux_dtype"] = static_cast<int64_t>(aux.scalar_type());
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["aux_dtype"].toInt());
    // On the incoming gradient's device: a CPU scalar here would reach the GPU through a
    // synchronising host-to-device copy, which a CUDA graph capture refuses.
    return {grads[0], at::full({}, scale, grads[0].options().dtype(dtype)), at::Tensor()};
  }
};

// Flight-recorder and trace labels of expert parallelism's exchanges.
const std::string kExchangeLabels[2][2] = {{"moe all_to_all dispatch", "moe all_to_all dispatch (backward)"},
                                           {"moe all_to_all combine", "moe all_to_all combine (backward)"}};
enum Exchange : int64_t { kDispatch = 0, kCombine = 1 };

// Rows [N, dim] over `exchange`: in_rows[j] of them to rank j, out_rows[j] arriving from rank j, in
// rank order. Its backward is the inverse exchange of the gradient.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            TokenExchange* exchange, Exchange which, std::vector<int64_t> in_rows,
                            std::vector<int64_t> out_rows) {
    ctx->saved_data["exchange"] = reinterpret_cast<int64_t>(exchange);
    ctx->saved_data["which"] = static_cast<int64_t>(which);
    ctx->saved_data["in"] = in_rows;
    ctx->saved_data["out"] = out_rows;
    return exchange->exchange_rows(x, in_rows, out_rows, kExchangeLabels[which][0]);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* exchange = reinterpret_cast<TokenExchange*>(ctx->saved_data["exchange"].toInt());
    const auto which = ctx->saved_data["which"].toInt();
    const auto in_rows = ctx->saved_data["in"].toIntVector(), out_rows = ctx->saved_data["out"].toIntVector();
    return {exchange->exchange_rows(grads[0], out_rows, in_rows, kExchangeLabels[which][1]), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Sums of `n` consecutive values each: per-rank totals of per-expert counts.
std::vector<int64_t> sums_of(const int64_t* v, int64_t count, int64_t n) {
  std::vector<int64_t> out(count / n, 0);
  for (int64_t i = 0; i < count; ++i) out[i / n] += v[i];
  return out;
}

// SwiGLU's gate silu(a) * b, by the kernel or by the composition (models/cpu/kernels.hpp).
at::Tensor silu_gate(const at::Tensor& a, const at::Tensor& b, bool fused) {
  return fused ? swiglu(a, b) : swiglu_reference(a, b);
}

}  // namespace

thread_local bool detail::building_unallocated = false;

void detail::init_normal(at::Tensor& w, double std) {
  if (building_unallocated) return;
  at::NoGradGuard g;
  w.normal_(0.0, std);
}

void RouterStats::add(const at::Tensor& aux_z_dropped, int64_t assigned) {
  at::NoGradGuard g;
  // at::full, not at::tensor: a fill on the device rather than a copy from host memory, which a
  // CUDA graph capture would refuse.
  const auto f64 = aux_z_dropped.options().dtype(at::kDouble);
  const auto one =
      at::cat({aux_z_dropped.to(at::kDouble), at::full({1}, double(assigned), f64), at::full({1}, 1.0, f64)});
  if (sums.defined())
    sums.add_(one);
  else
    sums = one;
}

void RouterStats::reset() {
  if (sums.defined()) sums.zero_();
}

RouterStats::Values RouterStats::read() const {
  if (!sums.defined()) return {};
  const auto h = sums.to(at::kCPU);
  const auto* p = h.data_ptr<double>();
  return {p[0], p[1], static_cast<int64_t>(p[2]), static_cast<int64_t>(p[3]), static_cast<int64_t>(p[4])};
}

double RouterStats::dropped_fraction() const {
  const auto v = read();
  return v.assignments ? double(v.dropped) / double(v.assignments) : 0.0;
}

int64_t MoEConfig::parameter_count() const {
  const int64_t hd = head_dim(), qkv_rows = (heads + 2 * key_value_heads()) * hd;
  const int64_t attn = dim * qkv_rows + heads * hd * dim + (qkv_bias ? qkv_rows : 0) +
                       (qk_norm == "head"         ? 2 * hd
                        : qk_norm == "projection" ? (heads + key_value_heads()) * hd
                                                  : 0);
  const int64_t dense = 3 * dim * ffn_hidden;
  const int64_t moe =
      dim * experts + experts * 3 * dim * expert_hidden +
      (shared_expert ? 3 * dim * (shared_expert_hidden > 0 ? shared_expert_hidden : expert_hidden) +
                           (shared_expert_gate ? dim : 0)
                     : 0);
  int64_t n = (tie_embeddings ? 1 : 2) * vocab_size * dim + dim;
  for (int64_t i = 0; i < layers; ++i) n += attn + 2 * dim + (is_moe_layer(i) ? moe : dense);
  return n;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, bool fused_) : eps(eps_), fused(fused_) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) { return forward_residual(x, at::Tensor()).second; }

std::pair<at::Tensor, at::Tensor> RMSNormImpl::forward_residual(const at::Tensor& x, const at::Tensor& r) {
  return fused ? residual_rms_norm(x, r, weight, eps) : residual_rms_norm_reference(x, r, weight, eps);
}

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden, bool fused_, bool own_products_)
    : fused(fused_), own_products(own_products_) {
  auto lin = [](int64_t i, int64_t o) {
    return torch::nn::Linear(torch::nn::LinearOptions(i, o).bias(false));
  };
  w1 = register_module("w1", lin(dim, hidden));
  w3 = register_module("w3", lin(dim, hidden));
  w2 = register_module("w2", lin(hidden, dim));
}

at::Tensor SwiGLUImpl::forward(const at::Tensor& x) {
  const bool own = own_route(own_products, x);
  return linear(silu_gate(linear(x, w1->weight, own), linear(x, w3->weight, own), fused), w2->weight, own);
}

ExpertsImpl::ExpertsImpl(int64_t experts, int64_t dim, int64_t hidden, bool fused_, bool own_products_)
    : fused(fused_), own_products(own_products_) {
  w1 = register_parameter("w1", at::empty({experts, hidden, dim}));
  w3 = register_parameter("w3", at::empty({experts, hidden, dim}));
  w2 = register_parameter("w2", at::empty({experts, dim, hidden}));
}

at::Tensor ExpertsImpl::forward_one(int64_t e, const at::Tensor& x) {
  return at::matmul(silu_gate(at::matmul(x, w1[e].t()), at::matmul(x, w3[e].t()), fused), w2[e].t());
}

at::Tensor ExpertsImpl::forward_batched(const at::Tensor& x) {
  return at::bmm(silu_gate(at::bmm(x, w1.transpose(1, 2)), at::bmm(x, w3.transpose(1, 2)), fused),
                 w2.transpose(1, 2));
}

at::Tensor ExpertsImpl::forward(const at::Tensor& x, const at::Tensor& offsets) {
  if (!offsets.defined()) return forward_batched(x);
  if (x.is_cpu()) {
    const bool own = own_route(own_products, x);
    if (fused && !own) return expert_swiglu(x, w1, w3, w2, offsets);
    const auto h = silu_gate(grouped_linear(x, w1, offsets, own), grouped_linear(x, w3, offsets, own), fused);
    return grouped_linear(h, w2, offsets, own);
  }
  const auto ends = offsets.to(at::kCPU).to(at::kLong);
  const auto* end = ends.data_ptr<int64_t>();
  std::vector<at::Tensor> pieces;
  for (int64_t e = 0, begin = 0; e < count(); begin = end[e], ++e)
    if (end[e] > begin) pieces.push_back(forward_one(e, x.narrow(0, begin, end[e] - begin)));
  return pieces.empty() ? at::zeros_like(x) : at::cat(pieces);
}

RouterImpl::RouterImpl(int64_t dim, int64_t experts) {
  gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(dim, experts).bias(false)));
}

MoEImpl::MoEImpl(const MoEConfig& c, std::shared_ptr<RouterStats> s) : config(c), stats(std::move(s)) {
  router = register_module("router", Router(c.dim, c.experts));
  experts =
      register_module("experts", Experts(c.experts, c.dim, c.expert_hidden, c.fused_kernels, c.own_products));
  init_normal(router->gate->weight, c.init_std);
  init_normal(experts->w1, c.init_std);
  init_normal(experts->w3, c.init_std);
  init_normal(experts->w2, c.init_std / std::sqrt(2.0 * double(c.layers)));
  if (c.shared_expert) {
    const int64_t width = c.shared_expert_hidden > 0 ? c.shared_expert_hidden : c.expert_hidden;
    shared = register_module("shared", SwiGLU(c.dim, width, c.fused_kernels, c.own_products));
    init_normal(shared->w1->weight, c.init_std);
    init_normal(shared->w3->weight, c.init_std);
    init_normal(shared->w2->weight, c.init_std / std::sqrt(2.0 * double(c.layers)));
    if (c.shared_expert_gate) {
      shared_gate =
          register_module("shared_gate", torch::nn::Linear(torch::nn::LinearOptions(c.dim, 1).bias(false)));
      init_normal(shared_gate->weight, c.init_std);
    }
  }
}

Routing MoEImpl::route(const at::Tensor& flat) const {
  Routing r;
  // The gate runs in its own parameter's dtype (float32 under the usual mixed-precision recipe),
  // so that near-ties between experts are decided the same way whatever the compute dtype.
  const auto& gw = router->gate->weight;
  r.logits = at::matmul(flat.to(gw.scalar_type()), gw.t()).to(at::kFloat);
  const bool normalize = config.normalize_top_k && (config.top_k > 1 || config.score == "sigmoid");
  at::Tensor lse;
  if (config.score == "sigmoid") {
    r.scores = at::sigmoid(r.logits);
    auto [w, idx] = at::topk(r.scores, config.top_k, -1);
    r.weights = normalize ? w / w.sum(-1, /*keepdim=*/true) : w;
    r.experts = idx;
    lse = at::logsumexp(r.logits, -1);
  } else {
    auto top = config.fused_kernels ? softmax_top_k(r.logits, config.top_k, normalize)
                                    : softmax_top_k_reference(r.logits, config.top_k, normalize);
    r.scores = std::move(top.scores);
    r.weights = std::move(top.weights);
    r.experts = std::move(top.experts);
    lse = std::move(top.lse);
  }
  const int64_t T = flat.size(0), E = config.experts;
  // f_e: share of the T*k assignments that went to e (not differentiable); P_e: mean score of e,
  // scores normalised to sum to 1 per token.
  // A scatter rather than bincount, which reads the largest index on the host (no capture).
  const auto flat_idx = r.experts.reshape(-1);
  const auto counts = at::zeros({E}, r.scores.options())
                          .scatter_add_(0, flat_idx, at::ones(flat_idx.sizes(), r.scores.options()));
  const auto f = counts / double(T * config.top_k);
  const auto probs = config.score == "sigmoid" ? r.scores / r.scores.sum(-1, true) : r.scores;
  r.aux_loss = double(E) * (f * probs.mean(0)).sum();
  r.z_loss = lse.pow(2).mean();
  return r;
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const auto shape = x.sizes().vec();
  const auto flat = x.reshape({-1, x.size(-1)});
  const int64_t T = flat.size(0), k = config.top_k, E = config.experts;
  const Routing r = route(flat);
  const auto weights = r.weights.to(x.scalar_type());
  at::Tensor out;
  at::Tensor dropped = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(x.device()));
  if (config.routing == "capacity") {
    // Static shapes: assignments in priority order (every token's first choice, then the second
    // ...), each takes the next free slot of its expert; the ones past capacity go to a spare row
    // whose output is zero. Every step is a device operation with fixed shapes and no atomics
    // (assignment i is token i % T, so the k choices of a token are summed by a reduction), so the
    // layer can be captured in a CUDA graph and gives the same bits every time.
    const int64_t C = static_cast<int64_t>(std::ceil(config.capacity_factor * double(T * k) / double(E)));
    const auto e_flat = r.experts.t().reshape(-1);  // [k*T], k-major
    const auto w_flat = weights.t().reshape(-1);
    const auto one_hot = at::zeros({k * T, E}, e_flat.options()).scatter_(1, e_flat.unsqueeze(1), 1);
    const auto pos = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1);
    const auto keep = pos < C;
    const auto slots = at::where(keep, e_flat * C + pos, at::full_like(pos, E * C));
    auto buffer =
        at::zeros({E * C + 1, flat.size(1)}, flat.options()).index_copy(0, slots, flat.repeat({k, 1}));
    auto y = run_experts(buffer.narrow(0, 0, E * C).view({E, C, -1}), at::Tensor()).reshape({E * C, -1});
    y = at::cat({y, at::zeros({1, y.size(1)}, y.options())});
    const auto w_kept = w_flat * keep.to(w_flat.scalar_type());
    out = (y.index_select(0, slots) * w_kept.unsqueeze(1)).view({k, T, -1}).sum(0);
    dropped = double(T * k) - keep.sum().to(at::kDouble);
  } else {
    // Dropless: the assignments sorted by expert, every expert on exactly its rows. The sort keeps
    // the counts in a tensor, but the experts' grouped products size their work by them on the
    // host, so this path is not capturable: a CUDA graph needs capacity routing (the recipe
    // checks say so).
    const auto o = sort_by_expert(r.experts, E);
    const bool fused = config.fused_kernels;
    const auto y = run_experts(fused ? dispatch_rows(flat, o) : dispatch_rows_reference(flat, o), o.counts);
    out = fused ? combine_rows(y, weights, o) : combine_rows_reference(y, weights, o);
  }
  if (shared_gate)  // Qwen2-MoE's: the shared expert scaled per token by a sigmoid gate
    out = out +
          shared(flat) * at::sigmoid(linear(flat, shared_gate->weight, own_route(config.own_products, flat)));
  else if (shared)
    out = out + shared(flat);

  stats->add(at::stack({r.aux_loss.detach().to(at::kDouble), r.z_loss.detach().to(at::kDouble), dropped}),
             T * k);
  out = out.view(shape);
  const auto aux = config.aux_loss_coef * r.aux_loss + config.z_loss_coef * r.z_loss;
  if (at::GradMode::is_enabled() && aux.requires_grad())
    out = AttachAuxLoss::apply(out, aux, stats->aux_grad_scale);
  return out;
}

at::Tensor MoEImpl::call_experts(const at::Tensor& x, const at::Tensor& offsets) {
  if (experts_call_.is_empty()) return experts->forward(x, offsets);
  return experts_call_.forward(x, offsets);
}

at::Tensor MoEImpl::run_experts(const at::Tensor& rows, const at::Tensor& counts) {
  const bool slots = !counts.defined();
  if (!ep_ || ep_->size() == 1)
    return call_experts(rows, slots ? at::Tensor() : counts.cumsum(0).to(at::kInt));
  const int64_t ranks = ep_->size(), local = experts->count(), dim = rows.size(-1);
  if (slots) {
    // [E, C, dim] -> rank j gets experts [j*local, (j+1)*local) of every sender: [ranks, local, C, dim].
    const int64_t C = rows.size(1);
    const std::vector<int64_t> even(size_t(ranks), local * C);
    const auto got = AllToAllRows::apply(rows.reshape({-1, dim}), ep_.get(), kDispatch, even, even);
    const auto mine = got.view({ranks, local, C, dim}).transpose(0, 1).reshape({local, ranks * C, dim});
    const auto y =
        call_experts(mine, at::Tensor()).view({local, ranks, C, dim}).transpose(0, 1).reshape({-1, dim});
    return AllToAllRows::apply(y, ep_.get(), kCombine, even, even).view({-1, C, dim});
  }
  // Dropless: how many rows each sender has for each of this rank's experts, then the rows.
  auto received = at::empty_like(counts);
  ep_->exchange_counts(received, counts);
  const auto host = at::cat({counts, received}).to(at::kCPU);
  const int64_t E = counts.numel();
  const auto send = sums_of(host.data_ptr<int64_t>(), E, local),
             recv = sums_of(host.data_ptr<int64_t>() + E, E, local);
  const auto got = AllToAllRows::apply(rows, ep_.get(), kDispatch, send, recv);  // sender-major, then expert
  // Regroup by expert (stable: senders in rank order within an expert), compute, put back.
  const int64_t n = got.size(0);
  const auto expert_of =
      at::repeat_interleave(at::arange(E, counts.options()).remainder(local), received, 0, n);
  const auto order = std::get<1>(at::sort(expert_of, /*stable=*/true, 0, false));
  const auto offsets = received.view({ranks, local}).sum(0).cumsum(0).to(at::kInt);
  const auto y = call_experts(got.index_select(0, order), offsets);
  const auto back = at::empty_like(order).index_copy_(0, order, at::arange(n, order.options()));
  return AllToAllRows::apply(y.index_select(0, back), ep_.get(), kCombine, recv, send);
}

void MoEImpl::set_expert_parallel(std::shared_ptr<TokenExchange> ep) {
  TORCH_CHECK(experts_call_.is_empty(), "MoE: set_expert_parallel before wrapping the experts");
  TORCH_CHECK(ep && config.experts % ep->size() == 0, "MoE: expert parallelism over ", ep ? ep->size() : 0,
              " ranks needs a rank count dividing the ", config.experts, " experts");
  TORCH_CHECK(experts->count() == config.experts, "MoE: expert parallelism is already set");
  ep_ = std::move(ep);
  const int64_t local = config.experts / ep_->size(), first = ep_->rank() * local;
  at::NoGradGuard g;
  for (auto* w : {&experts->w1, &experts->w3, &experts->w2}) {
    auto shape = w->sizes().vec();
    shape[0] = local;
    w->set_data(is_unallocated(*w) ? unallocated_tensor(shape, w->options())
                                   : w->narrow(0, first, local).clone());
  }
}

void MoEImpl::wrap_experts(torch::nn::AnyModule wrapper) {
  replace_module("experts", wrapper.ptr());
  experts_call_ = std::move(wrapper);
}

BlockImpl::BlockImpl(const MoEConfig& c, int64_t index, std::shared_ptr<RouterStats> stats) {
  attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps, c.fused_kernels));
  attn = register_module("attn", Attention(c));
  ffn_norm = register_module("ffn_norm", RMSNorm(c.dim, c.norm_eps, c.fused_kernels));
  if (c.is_moe_layer(index)) {
    moe = register_module("moe", MoE(c, std::move(stats)));
  } else {
    mlp = register_module("mlp", SwiGLU(c.dim, c.ffn_hidden, c.fused_kernels, c.own_products));
    init_normal(mlp->w1->weight, c.init_std);
    init_normal(mlp->w3->weight, c.init_std);
    init_normal(mlp->w2->weight, c.init_std / std::sqrt(2.0 * double(c.layers)));
  }
}

at::Tensor BlockImpl::forward(at::Tensor x, at::Tensor positions) {
  // x + attn(attn_norm(x)), then that + ffn(ffn_norm(that)). The norms take the residual stream
  // with them (RMSNorm::forward_residual): the first add is the second norm's, and in backward
  // neither norm's input gradient needs a separate add of the stream's.
  const auto [x0, h0] = attn_norm->forward_residual(x, at::Tensor());
  const auto [x1, h1] = ffn_norm->forward_residual(x0, attn(h0, positions));
  return x1 + (moe ? moe(h1) : mlp(h1));
}

MoETransformerImpl::MoETransformerImpl(const MoEConfig& c, Weights weights)
    : config_(c), stats_(std::make_shared<RouterStats>()), first_(0), last_(c.layers) {
  struct Drawing {  // whether init_normal draws, restored however the constructor ends
    bool before = building_unallocated;
    ~Drawing() { building_unallocated = before; }
  } drawing;
  building_unallocated = weights == Weights::kUnallocated;
  const auto built = [weights](const torch::nn::Module& part) {
    if (weights == Weights::kUnallocated)
      for (const auto& p : part.parameters()) resize_storage_bytes(p, 0);
  };
  embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.dim));
  init_normal(embed->weight, c.init_std);
  built(*embed);
  layers = register_module("layers", std::make_shared<torch::nn::Module>("Layers"));
  for (int64_t i = 0; i < c.layers; ++i) {
    blocks_.emplace_back(Block(c, i, stats_));
    built(*blocks_.back());
    calls_.emplace_back(blocks_.back());
    layers->register_module(std::to_string(i), blocks_.back().ptr());
  }
  norm = register_module("norm", RMSNorm(c.dim, c.norm_eps, c.fused_kernels));
  built(*norm);
  if (!c.tie_embeddings) {
    head =
        register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab_size).bias(false)));
    init_normal(head->weight, c.init_std);
    built(*head);
  }
}

MoETransformerImpl::MoETransformerImpl(const MoETransformerImpl& full, int64_t first, int64_t last)
    : config_(full.config_), stats_(std::make_shared<RouterStats>()), first_(first), last_(last) {
  TORCH_CHECK(full.first_ == 0 && full.last_ == full.config_.layers && !full.wrapped_,
              "MoETransformer: a stage is cut from a full model whose blocks are not wrapped");
  TORCH_CHECK(0 <= first && first < last && last <= config_.layers, "MoETransformer: stage layers [", first,
              ", ", last, ") are not within [0, ", config_.layers, ")");
  TORCH_CHECK(!config_.tie_embeddings || (first == 0 && last == config_.layers),
              "MoETransformer: with tie_embeddings the embedding and the head are one parameter, which one "
              "stage holds: a model with tied embeddings is not cut into pipeline stages");
  if (first == 0) embed = register_module("embed", full.embed);
  layers = register_module("layers", std::make_shared<torch::nn::Module>("Layers"));
  for (int64_t i = first; i < last; ++i) {
    blocks_.push_back(full.blocks_[i]);
    calls_.emplace_back(blocks_.back());
    layers->register_module(std::to_string(i), blocks_.back().ptr());
    // The stage keeps its own router statistics.
    if (auto& moe = blocks_.back()->moe) moe->stats = stats_;
  }
  if (last == config_.layers) {
    norm = register_module("norm", full.norm);
    if (full.head) head = register_module("head", full.head);
  }
}

at::Tensor MoETransformerImpl::forward(const at::Tensor& input) {
  at::Tensor h = has_embedding() ? embed(input) : input;
  if (!has_embedding()) {
    // Hidden states arrive in float32 between stages; compute in the layers' dtype.
    h = h.to(blocks_.front()->attn->qkv->weight.scalar_type());
  }
  for (auto& b : calls_) h = b.forward(h, positions_);
  if (!has_head()) return h;
  const auto normed = norm(h);
  return linear(normed, output_weight(), own_route(config_.own_products, normed)).to(at::kFloat);
}

void MoETransformerImpl::set_expert_parallel(const std::shared_ptr<TokenExchange>& ep) {
  TORCH_CHECK(!wrapped_, "MoETransformer: set_expert_parallel before wrapping the blocks");
  for (auto& b : blocks_)
    if (b->moe) b->moe->set_expert_parallel(ep);
}

void MoETransformerImpl::wrap_blocks(const std::function<torch::nn::AnyModule(const Block&, int64_t)>& wrap) {
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const int64_t layer = first_ + int64_t(i);
    calls_[i] = wrap(blocks_[i], layer);
    layers->replace_module(std::to_string(layer), calls_[i].ptr());
  }
  wrapped_ = true;
}

}  // namespace fsdpp::models
