#pragma once
// ParamGroup: the parameters of one sharded unit and the collectives that move them.
//
// Each parameter is chunked along dim 0 across the ranks of the communicator, with padding:
// rows r * ceil(R/n) .. min(R, (r+1) * ceil(R/n)) live on rank r, so trailing ranks may own zero
// rows (5 rows on 4 ranks: 2, 2, 1, 0). A rank keeps its rows in a zero-padded float buffer; the
// optimizer sees a view of the real rows (sharded_parameters()).
//
// Note [unshard by storage resize]
// The module's parameter tensors stay the same objects for the module's lifetime. At sharding time
// each one is pointed (set_data, once) at its place in one buffer for the whole unit, in its
// compute dtype, 64-byte aligned; the buffer's storage is then freed. Unsharding re-allocates that
// storage (one allocation for the unit, not one per parameter) and fills it from one all-gather;
// resharding frees it again. Autograd's saved references to the parameters therefore stay valid:
// only the bytes behind them come and go. Reading a parameter while its unit is resharded is an
// error.
//
// Layout: all-gather and reduce-scatter use one rank-major layout, [rank 0: p0 | p1 | ...][rank 1:
// p0 | p1 | ...]..., where pi is parameter i's padded shard. The all-gather packs as bytes, so one
// collective serves a unit whose parameters have different dtypes; the all-gather input is a view
// of this rank's slot of the output.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "fsdpp/comm/comm.hpp"
#include "fsdpp/fsdp/mixed_precision.hpp"

namespace fsdpp::fsdp {

// Where one parameter's shard lives, as a checkpoint or a test needs to know.
struct ShardInfo {
  std::vector<std::string> names;  // FQNs in the unwrapped model; several when tied
  std::vector<int64_t> global_shape;
  int64_t row_offset = 0;  // first global row on this rank
  int64_t local_rows = 0;
  int64_t padded_rows = 0;  // ceil(rows / world size)
  at::ScalarType compute_dtype = at::kFloat;
  // The sharded gradient's dtype (mixed_precision.hpp); nullopt: none, the reduce-scatter's as it
  // comes.
  std::optional<at::ScalarType> grad_dtype;
};

struct ParamSpec {
  std::vector<std::string> names;
  at::Tensor param;  // the module's parameter
};

class ParamGroup {
 public:
  // post_forward_group > 1: reshard_to_group() keeps 1/post_forward_group of the gathered
  // parameters, and the next unshard gathers within groups of that many consecutive ranks.
  // `replicate` (HSDP): the replicas of this shard group; finish_reduce() averages the reduced
  // shards across them. `blocks` (expert parallelism): the parameters are block `blocks.rank()`
  // of `blocks.size()` along dim 0 of the whole tensors (FullyShardOptions::expert_parallel).
  ParamGroup(comm::Comm comm, std::vector<ParamSpec> params, const MixedPrecisionPolicy& mp,
             std::string label, int post_forward_group = 0, bool static_buffers = false,
             std::optional<comm::Comm> replicate = std::nullopt,
             std::optional<comm::Comm> blocks = std::nullopt);

  const std::string& label() const { return label_; }
  void set_label(const std::string& label);
  const comm::Comm& comm() const { return comm_; }
  bool empty() const { return params_.empty(); }
  bool is_unsharded() const { return unsharded_; }
  // Where the gather and reduce buffers and the unsharded parameters live now (null when
  // released): with static buffers, the same from the first step on.
  std::vector<const void*> buffer_addresses() const;

  // Issues the all-gather (no-op when unsharded or already in flight).
  void unshard_async();
  // Completes the all-gather and fills the parameters.
  void wait_unshard();
  void reshard();
  // Frees the unsharded parameters but keeps this rank's 1/N of the gathered bytes (N =
  // post_forward_group), so that the next unshard is an all-gather among N ranks only.
  void reshard_to_group();

  // Note [unsharded gradients]: the unsharded gradients accumulate in the parameters' own .grad,
  // in the dtypes PyTorch 2.15 gives them. Before a backward: lets the gradients of parameters
  // whose accumulation dtype is wider than their compute dtype arrive as autograd makes them when
  // that costs nothing in precision (`reducing`, or a .grad to add to in place).
  void defer_grad_upcasts(bool reducing);
  // After a backward: casts any such gradient to its accumulation dtype and makes it the dtype
  // the next backward's gradients arrive in.
  void restore_grad_dtypes();
  // Takes each parameter's .grad (zeros for parameters that got none), packs them and issues one
  // reduce-scatter that averages over the ranks.
  void reduce_grads_async();
  // Waits for the reduce-scatter (and, with replicas, averages its result across them) and adds
  // the result to the sharded parameters' gradients. On the CPU, a parameter without a gradient
  // gets its last one back, refilled, when nothing else holds it (Note [spare gradients]).
  void finish_reduce();
  // Waits for the reduce-scatter, divides its result by the expert-parallel block count and, with
  // replicas, issues the all-reduce that averages it across them without waiting for it (Note
  // [replica average]); finish_reduce() then waits. Nothing to do when no reduce-scatter is in
  // flight (none pending, or this ran already).
  void average_replicas_async();
  bool reduce_pending() const { return reduce_pending_; }
  // True when some parameter holds a .grad (after the reduce-scatter took them: one that came late).
  bool has_stray_grads() const;

  std::vector<at::Tensor> sharded_parameters() const;
  // Bytes of this rank's parameters while gathered (compute dtype; with expert parallelism, this
  // rank's block).
  int64_t unsharded_bytes() const;
  // Bytes this rank holds now besides its shards and gradients: the unsharded parameters, the
  // all-gather's buffer, and after reshard_to_group() the 1/N of it kept for the next unshard.
  int64_t held_bytes() const;
  // Rows and shapes of the whole tensors (with expert parallelism, not just this rank's block).
  std::vector<ShardInfo> shard_infos() const;
  // Full parameters in their original dtype, in the order of shard_infos(); collective (over the
  // blocks' communicator too).
  std::vector<at::Tensor> gather_full_params();
  // Sets this rank's rows from full parameters (same order, whole tensors); not collective.
  void load_full_params(const std::vector<at::Tensor>& full);

 private:
  struct Param {
    std::vector<std::string> names;
    at::Tensor param;              // the module's parameter (identity kept)
    at::Tensor unsharded;          // full-size compute-dtype view of the unit's unsharded buffer, as param is
    int64_t unsharded_offset = 0;  // bytes into the unsharded buffer
    at::Tensor padded;             // this rank's rows, zero-padded to padded_rows, original dtype
    // padded's bytes, where Note [raw copies] reads them (on the CPU, in the compute dtype); null
    // where they go through the views. padded's storage is made once and never resized.
    const char* padded_raw = nullptr;
    at::Tensor sharded;     // leaf view of padded's real rows: what the optimizer updates
    at::Tensor taken_grad;  // the unsharded gradient taken for the reduce-scatter being packed
    std::vector<int64_t> shape;
    int64_t rows = 0, padded_rows = 0, row_offset = 0, local_rows = 0, row_numel = 1;
    at::ScalarType compute_dtype;
    // Note [unsharded gradients]; nullopt: none (autograd's dtype).
    std::optional<at::ScalarType> unsharded_grad_dtype, sharded_grad_dtype;
    bool wider_grad = false;                      // unsharded_grad_dtype is wider than compute_dtype
    bool explicit_grad_dtype = false;             // the policy gave one (a dtype or none)
    int64_t gather_offset = 0, gather_bytes = 0;  // within one rank's slot of the all-gather
    int64_t reduce_offset = 0;                    // elements, within one rank's reduce slot
    // Views into the persistent buffers, made once (see Note [persistent views]).
    at::Tensor copy_in;                                       // in this rank's gather slot
    std::vector<std::pair<at::Tensor, at::Tensor>> copy_out;  // (unsharded rows, gathered rows)
    struct Pack {
      at::Tensor dst;  // rows of the reduce input
      int64_t offset;  // of dst's first element in the flattened gradient
    };
    std::vector<Pack> pack;
    std::vector<at::Tensor> pad;  // parts of the reduce input beyond the parameter: zeroed
    at::Tensor reduce_all;        // the parameter's whole region of the reduce input
    at::Tensor reduce_piece;      // this rank's rows in the reduce output
    at::Tensor spare_grad;        // the last sharded gradient handed out (Note [spare gradients])
    int64_t padded_numel() const { return padded_rows * row_numel; }
    int64_t numel() const { return rows * row_numel; }
    // Rank r holds elements [r * padded_numel(), (r + 1) * padded_numel()) of the flattened
    // parameter: the first full_pieces() ranks a whole piece, the next one last_piece() elements
    // when that is not 0, and any after it none. Both need padded_numel() > 0.
    int64_t full_pieces() const { return numel() / padded_numel(); }
    int64_t last_piece() const { return numel() % padded_numel(); }
  };

  void check_plan_is_uniform();
  void make_views();
  // reduce_in: the start of the reduce input's bytes.
  bool pack_raw(Param& q, char* reduce_in);
  // q's spare gradient (of `dtype`) when nothing else holds it, else a new one (kept as the spare
  // if `keep`).
  static at::Tensor spare_or_new_grad(Param& q, at::ScalarType dtype, bool keep);

  comm::Comm comm_;
  std::optional<comm::Comm> replicate_;  // HSDP: this shard group's replicas
  std::optional<comm::Comm> blocks_;     // expert parallelism: the ranks holding the other blocks
  int64_t block_count() const { return blocks_ ? blocks_->size() : 1; }
  int64_t block_index() const { return blocks_ ? blocks_->rank() : 0; }
  // The whole tensor's shape, and where this rank's rows start in it (expert parallelism: past the
  // blocks of lower ranks).
  std::vector<int64_t> whole_shape(const Param& q) const;
  int64_t whole_row_offset(const Param& q) const { return block_index() * q.rows + q.row_offset; }
  std::string label_;
  std::string gather_label_, reduce_label_,
      replicate_label_;  // flight-recorder labels of this unit's collectives
  std::vector<Param> params_;
  int64_t gather_slot_bytes_ = 0;
  int64_t reduce_slot_numel_ = 0;
  at::ScalarType reduce_dtype_ = at::kFloat;
  bool unsharded_ = false;
  bool static_buffers_ = false;
  // Note [raw copies]: on the CPU, a step's same-dtype packing and unpacking are memcpys at offsets
  // fixed here (with many small units, reading the views of Note [persistent views] costs more
  // cache misses than the bytes they describe); the views serve the rest (casts, CUDA).
  bool host_ = false;
  int64_t comm_rank_ = 0, comm_size_ = 1;
  // Note [one-rank buffers]: a CPU group alone in its shard group; its gather buffer is its
  // unsharded buffer and its reduce-scatter's output its input.
  bool alone() const { return host_ && comm_size_ == 1; }
  at::Device device_ = at::kCPU;  // of every parameter, buffer and plan-check tensor of the group
  // Storage management behind unshard/reshard (Note [unshard by storage resize]); with static
  // buffers, release is a no-op and allocate finds the storage in place. allocate returns the
  // start of the storage's bytes.
  char* allocate(const at::Tensor& t, size_t nbytes) const;
  void release(const at::Tensor& t) const;
  at::Tensor unsharded_buf_;  // bytes behind every unsharded parameter, allocated while unsharded
  at::Tensor
      gather_buf_;  // [ranks x slot] bytes, storage allocated only while in use (alone: unsharded_buf_)
  at::Tensor gather_slot_;  // this rank's slot of gather_buf_
  at::Tensor
      reduce_buf_;  // likewise, in reduce_dtype: [ranks x slot] input, then a slot of output (alone: one slot, both)
  at::Tensor reduce_in_, reduce_out_;  // its two parts
  // The starts of the gather and reduce buffers' bytes while allocated, as allocate returned them
  // (Note [raw copies]).
  char* gathered_raw_ = nullptr;
  char* reduce_raw_ = nullptr;
  comm::Comm group_comm_;   // N consecutive ranks, for reshard_to_group
  at::Tensor group_shard_;  // this rank's 1/N of the gather buffer while resharded to the group
  std::optional<comm::Work> gather_work_;
  std::optional<comm::Work> reduce_work_;     // the reduce-scatter, until it is waited for
  std::optional<comm::Work> replicate_work_;  // then the replicas' all-reduce (Note [replica average])
  bool reduce_pending_ = false;               // from reduce_grads_async() to finish_reduce()
};

}  // namespace fsdpp::fsdp
