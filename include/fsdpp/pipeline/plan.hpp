#pragma once
// From a schedule and a spec to a checked, lowered program: the path every schedule takes,
// built-in or not, before any communication happens.

#include <string>
#include <vector>

#include "fsdpp/pipeline/fsdp_actions.hpp"
#include "fsdpp/pipeline/lowering.hpp"
#include "fsdpp/pipeline/schedule.hpp"
#include "fsdpp/pipeline/send_waits.hpp"
#include "fsdpp/pipeline/simulator.hpp"

namespace fsdpp::pipeline {

struct Plan {
  ScheduleSpec spec;
  Program compute;                // each rank's compute actions
  std::vector<int> owner;         // stage -> rank
  Program lowered;                // with sends, receives and their waits (and FSDP actions when asked)
  int max_outstanding_sends = 0;  // 0: unlimited
};

struct PlanOptions {
  // Stages sharded over data-parallel ranks: UNSHARD/RESHARD around each stage's use and
  // REDUCE_GRAD after its last backward.
  bool fsdp_stages = false;
  // A rank never has more sends in flight (0: unlimited). The plan keeps it as PyTorch 2.15 does,
  // moving send waits earlier (send_budget.hpp); where no wait can move without the program waiting
  // on itself (2.15 refuses the budget there), the waits stay and the executor keeps the budget as
  // it runs, the simulation posting receives earlier until it cannot deadlock, or the plan is
  // refused saying so.
  int max_outstanding_sends = 0;
  // With fsdp_stages: how many of a rank's stages stay gathered at once, counted in the distinct
  // stages of its next compute actions (the current one first). 1 keeps only the stage being
  // computed (least memory, a gather at every change of stage); more keep stages gathered across
  // interleaved microbatches. PyTorch 2.15's `max_active_stages`.
  int max_active_stages = 3;
  // With fsdp_stages: how far ahead of use each rank gathers (UnshardLookahead).
  UnshardLookahead unshard_lookahead;
  // With fsdp_stages: where each REDUCE_GRAD's WAIT_REDUCE_GRAD goes: right after it (false, as
  // PyTorch 2.15's `defer_reduce_grad_wait` defaults), or before the rank's next REDUCE_GRAD (or at
  // the end), so that the reduction overlaps the computations in between (true).
  bool defer_reduce_grad_wait = false;
  // Where a receive is posted: as soon as the lowering has its sender emit the send (false, PyTorch
  // 2.15's default: on the receiving rank's program at that point, as _add_send_recv places it), or
  // as late as it can be (true, 2.15's `defer_pp_recv=True`, defer_receives: before the computation
  // that uses it, or before a send to a higher-numbered peer that it comes from; its buffer lives
  // no longer than needed). Either way a receive comes earlier where the order between two ranks
  // needs it (Note [point-to-point order]). bench/results/defer_pp_recv.md times both.
  bool defer_pp_recv = false;
};

// Note [plan size]
// Planning a step (lowering, the send-budget pass, validation, simulation) takes time that grows
// faster than linearly in a rank's actions: about 1 s for 8,192 stage-microbatches on one rank or
// 65,536 in all, minutes past a million. Steps are bounded well beyond the shapes people run; more
// microbatches belong in gradient accumulation (several steps per optimizer step).
inline constexpr int64_t kMaxStageMicrobatches = 1 << 17;         // pp x stages per rank x microbatches
inline constexpr int64_t kMaxStageMicrobatchesPerRank = 1 << 13;  // stages per rank x microbatches

// Throws ScheduleError naming the rank and action when the schedule is invalid or deadlocks.
// Between any two ranks, sends and receives come in the same order (Note [point-to-point order]).
//   make_plan(*make_schedule("1F1B"), {.pp = 2, .microbatches = 8}, {.fsdp_stages = true})
inline Plan make_plan(const Schedule& schedule, const ScheduleSpec& spec, const PlanOptions& options = {}) {
  const bool fsdp_stages = options.fsdp_stages;
  const int max_outstanding_sends = options.max_outstanding_sends;
  const auto lookahead =
      resolve_unshard_lookahead(options.unshard_lookahead, spec.pp, options.max_active_stages);
  schedule.check(spec);
  const int64_t per_rank = int64_t{spec.stages_per_rank} * spec.microbatches, all = per_rank * spec.pp;
  if (all > kMaxStageMicrobatches || per_rank > kMaxStageMicrobatchesPerRank)
    throw ScheduleError(schedule.name() + ": " + std::to_string(spec.pp) + " ranks x " +
                        std::to_string(spec.stages_per_rank) + " stages x " +
                        std::to_string(spec.microbatches) + " microbatches is past what a plan holds (" +
                        std::to_string(kMaxStageMicrobatchesPerRank) + " stage-microbatches per rank, " +
                        std::to_string(kMaxStageMicrobatches) +
                        " in all): take fewer microbatches per step and accumulate gradients over steps");
  Plan p;
  p.spec = spec;
  p.compute = schedule.compute_actions(spec);
  if (static_cast<int>(p.compute.size()) != spec.pp)
    throw ScheduleError(schedule.name() + ": " + std::to_string(p.compute.size()) + " ranks for pp " +
                        std::to_string(spec.pp));
  validate_compute(p.compute, spec.num_stages(), spec.microbatches);
  p.owner = infer_stage_ranks(p.compute, spec.num_stages());
  for (int s = 0; s < spec.num_stages(); ++s)
    if (schedule.places_stages_by_layout() && p.owner[s] != stage_rank(schedule.layout(), s, spec.pp))
      throw ScheduleError(schedule.name() + ": stage " + std::to_string(s) + " is on rank " +
                          std::to_string(p.owner[s]) + ", not where its layout puts it");
  if (auto own = schedule.lowered_actions(spec)) {
    validate_send_recv(*own, p.owner);
    check_point_to_point_order(*own, p.owner);
    if (has_fsdp_actions(*own)) {  // placed already: kept as they are, on sharded stages only
      if (!fsdp_stages)
        throw ScheduleError(
            schedule.name() +
            ": the program holds UNSHARD, RESHARD and REDUCE_GRAD actions, but its stages are not "
            "sharded (data-parallel fully_shard stages: parallel.dp > 1, or --fsdp)");
      validate_fsdp_actions(*own);
      p.lowered = std::move(*own);
    } else if (fsdp_stages) {
      p.lowered = add_reduce_grad(add_unshard_reshard(*own, options.max_active_stages, lookahead),
                                  spec.microbatches, options.defer_reduce_grad_wait);
    } else {
      p.lowered = std::move(*own);
    }
  } else {
    // The FSDP actions go in before the messages, as 2.15's passes run: each takes its turn in the
    // lowering as a computation does, which decides where an early receive lands.
    auto actions = p.compute;
    if (fsdp_stages)
      actions = add_reduce_grad(add_unshard_reshard(actions, options.max_active_stages, lookahead),
                                spec.microbatches, options.defer_reduce_grad_wait);
    p.lowered = add_send_recv(actions, p.owner, /*early_receives=*/true);
    if (options.defer_pp_recv) p.lowered = defer_receives(p.lowered, p.owner);
    order_receives(p.lowered, p.owner);
  }
  validate_reduce_waits(p.lowered);
  if (!has_send_waits(p.lowered)) p.lowered = add_send_waits(p.lowered);  // a table may place its own
  validate_send_waits(p.lowered);
  p.max_outstanding_sends = max_outstanding_sends;
  if (max_outstanding_sends > 0) {
    try {
      p.lowered = add_send_budget_waits(p.lowered, p.owner, max_outstanding_sends);
      validate_send_waits(p.lowered);
    } catch (const ScheduleError&) {  // the budget is kept at run time instead (see below)
    }
  }
  // Prove the lowered program runs to the end. Under a send budget kept at run time, a send may
  // wait for a receive its peer has not posted yet because the peer itself waits; then that
  // receive is posted earlier (where the peer is stuck), which breaks the cycle at the cost of a
  // longer-lived buffer, and the receives it overtook on its edge move with it (Note
  // [point-to-point order]).
  for (int attempt = 0;; ++attempt) {
    std::vector<BudgetBlocker> blockers;
    try {
      simulate(p.lowered, p.owner, {}, max_outstanding_sends, &blockers);
      break;
    } catch (const ScheduleError&) {
      if (blockers.empty() || attempt > 100000) throw;
      for (const auto& b : blockers) hoist_recv(p.lowered, b.rank, b.recv, b.stuck_at);
      order_receives(p.lowered, p.owner);
    }
  }
  check_point_to_point_order(p.lowered, p.owner);
  for (int r = 0; r < spec.pp; ++r) validate_groups(p.lowered[r], r);  // every pass kept them whole
  return p;
}

}  // namespace fsdpp::pipeline
