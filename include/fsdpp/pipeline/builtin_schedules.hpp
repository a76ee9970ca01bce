#pragma once
// The built-in schedules, registered by name on first use of the registry (schedule.hpp).

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdpp/pipeline/schedule.hpp"

namespace fsdpp::pipeline {

namespace detail {

inline Action act(int stage, ActionType t, int mb) { return {stage, t, mb}; }

}  // namespace detail

// All forwards, then all backwards (one stage per rank).
class GPipe : public Schedule {
 public:
  std::string name() const override { return "GPipe"; }
  void check(const ScheduleSpec& s) const override {
    Schedule::check(s);
    if (s.stages_per_rank != 1) throw ScheduleError("GPipe: one stage per rank");
  }
  Program compute_actions(const ScheduleSpec& s) const override {
    Program p(s.pp);
    for (int r = 0; r < s.pp; ++r) {
      for (int m = 0; m < s.microbatches; ++m) p[r].push_back(detail::act(r, ActionType::kForward, m));
      for (int m = 0; m < s.microbatches; ++m) p[r].push_back(detail::act(r, ActionType::kBackward, m));
    }
    return p;
  }
};

// Warm-up forwards (p - r of them), then alternate one backward and one forward, then drain.
class OneFOneB : public Schedule {
 public:
  std::string name() const override { return "1F1B"; }
  void check(const ScheduleSpec& s) const override {
    Schedule::check(s);
    if (s.stages_per_rank != 1) throw ScheduleError("1F1B: one stage per rank");
    if (s.microbatches < s.pp)
      throw ScheduleError("1F1B: needs at least as many microbatches (" + std::to_string(s.microbatches) +
                          ") as pipeline ranks (" + std::to_string(s.pp) + ")");
  }
  Program compute_actions(const ScheduleSpec& s) const override {
    Program p(s.pp);
    for (int r = 0; r < s.pp; ++r) {
      const int warmup = std::min(s.microbatches, s.pp - r);
      int f = 0, b = 0;
      while (f < warmup) p[r].push_back(detail::act(r, ActionType::kForward, f++));
      while (b < s.microbatches) {
        p[r].push_back(detail::act(r, ActionType::kBackward, b++));
        if (f < s.microbatches) p[r].push_back(detail::act(r, ActionType::kForward, f++));
      }
    }
    return p;
  }
};

// Breadth-first over several stages per rank (stages r, r+p, ...): every forward of a stage, then
// the next stage; backwards in reverse.
class LoopedBFS : public Schedule {
 public:
  std::string name() const override { return "LoopedBFS"; }
  Program compute_actions(const ScheduleSpec& s) const override {
    Program p(s.pp);
    const int v = s.stages_per_rank, m = s.microbatches;
    for (int r = 0; r < s.pp; ++r) {
      for (int c = 0; c < v; ++c)
        for (int mb = 0; mb < m; ++mb) p[r].push_back(detail::act(c * s.pp + r, ActionType::kForward, mb));
      for (int c = v - 1; c >= 0; --c)
        for (int mb = m - 1; mb >= 0; --mb)
          p[r].push_back(detail::act(c * s.pp + r, ActionType::kBackward, mb));
    }
    return p;
  }
};

// Megatron's interleaved 1F1B (depth-first over v stages per rank); with zero_bubble, PyTorch's
// interleaved zero-bubble variant: I instead of B, and each rank defers its W by its rank index
// to fill the drain bubble.
class Interleaved1F1B : public Schedule {
 public:
  explicit Interleaved1F1B(bool zero_bubble = false) : zero_bubble_(zero_bubble) {}
  std::string name() const override { return zero_bubble_ ? "InterleavedZeroBubble" : "Interleaved1F1B"; }
  void check(const ScheduleSpec& s) const override {
    Schedule::check(s);
    const int rounds = std::max(1, s.microbatches / s.pp);
    if (s.microbatches % rounds != 0)
      throw ScheduleError(name() + ": microbatches (" + std::to_string(s.microbatches) +
                          ") must be a multiple of " + std::to_string(rounds) +
                          " (rounds of up to pp microbatches)");
  }
  Program compute_actions(const ScheduleSpec& s) const override {
    Program p(s.pp);
    const int v = s.stages_per_rank, m = s.microbatches, pp = s.pp;
    const int rounds = std::max(1, m / pp), per_round = m / rounds, total = v * m;
    auto fwd = [&](int k, int r) {
      return detail::act(((k / per_round) % v) * pp + r, ActionType::kForward,
                         (k / (per_round * v)) * per_round + k % per_round);
    };
    const ActionType back = zero_bubble_ ? ActionType::kBackwardInput : ActionType::kBackward;
    auto bwd = [&](int k, int r) {
      return detail::act((v - 1 - (k / per_round) % v) * pp + r, back,
                         (k / (per_round * v)) * per_round + k % per_round);
    };
    for (int r = 0; r < pp; ++r) {
      const int warmup = std::min((v - 1) * per_round + (zero_bubble_ ? 1 : 2) * (pp - 1 - r), total);
      std::vector<Action> pending_w;
      size_t next_w = 0;
      auto after_backward = [&](int b, const Action& a) {
        if (!zero_bubble_) return;
        pending_w.push_back({a.stage, ActionType::kBackwardWeight, a.microbatch});
        if (b >= r && next_w < pending_w.size()) p[r].push_back(pending_w[next_w++]);
      };
      int f = 0, b = 0;
      while (f < warmup) p[r].push_back(fwd(f++, r));
      while (b < total) {
        if (f < total) p[r].push_back(fwd(f++, r));
        const Action a = bwd(b, r);
        p[r].push_back(a);
        after_backward(b++, a);
      }
      while (next_w < pending_w.size()) p[r].push_back(pending_w[next_w++]);
    }
    return p;
  }

 private:
  bool zero_bubble_;
};

// ZB-V: two stages per rank in a V (rank r holds stages r and 2p-1-r), with I/W split; zero bubble
// when F, I and W cost the same.
class ZBVZeroBubble : public Schedule {
 public:
  std::string name() const override { return "ZBVZeroBubble"; }
  Layout layout() const override { return Layout::kV; }
  void check(const ScheduleSpec& s) const override {
    Schedule::check(s);
    if (s.stages_per_rank != 2) throw ScheduleError("ZBVZeroBubble: exactly 2 stages per rank");
  }
  Program compute_actions(const ScheduleSpec& s) const override {
    Program p(s.pp);
    const int pp = s.pp, m = s.microbatches, n = std::max(2 * pp - 1, m);
    for (int r = 0; r < pp; ++r) {
      const int c0 = r, c1 = 2 * pp - 1 - r;
      int f0 = 0, f1 = 0, i0 = 0, i1 = 0, w0 = 0, w1 = 0;
      auto& out = p[r];
      auto emit = [&](int stage, ActionType t, int& counter) {
        const int mb = counter++;
        if (mb < m) out.push_back({stage, t, mb});  // the V is built for n; extra microbatches vanish
      };
      using T = ActionType;
      for (int k = 0; k < 2 * (pp - r) - 1; ++k) emit(c0, T::kForward, f0);
      for (int k = 0; k < r; ++k) emit(c1, T::kForward, f1), emit(c0, T::kForward, f0);
      for (int k = 0; k < pp - r; ++k)
        emit(c1, T::kForward, f1), emit(c1, T::kBackwardInput, i1), emit(c1, T::kBackwardWeight, w1);
      while (f1 < f0 || f0 < n) {
        if (f0 < n) emit(c0, T::kForward, f0);
        emit(c0, T::kBackwardInput, i0), emit(c0, T::kBackwardWeight, w0);
        emit(c1, T::kForward, f1), emit(c1, T::kBackwardInput, i1), emit(c1, T::kBackwardWeight, w1);
      }
      for (int k = 0; k < r; ++k) emit(c0, T::kBackwardInput, i0), emit(c1, T::kBackwardInput, i1);
      for (int k = 0; k < pp - r; ++k) emit(c0, T::kBackwardInput, i0), emit(c0, T::kBackwardWeight, w0);
      while (w1 < n) emit(c1, T::kBackwardWeight, w1);
      while (w0 < n) emit(c0, T::kBackwardWeight, w0);
    }
    return p;
  }
};

// DualPipeV: DeepSeek's DualPipe folded into a V (rank r holds stages r and 2p-1-r), as PyTorch
// 2.15's ScheduleDualPipeV. In the steady state a rank pairs the forward of one of its stages with
// the full backward of the other in an OVERLAP_F_B group (Note [overlap groups]): the two run at
// once, so that each one's communication hides behind the other's compute. The ramp-up
// splits the backwards of each rank's second stage (2p-1-r) into I and W to fill its bubbles, and
// the drain splits both stages' backwards from its middle on, each W deferred to a slot that
// would otherwise idle. Needs m >= 2p.
class DualPipeV : public Schedule {
 public:
  std::string name() const override { return "DualPipeV"; }
  Layout layout() const override { return Layout::kV; }
  void check(const ScheduleSpec& s) const override {
    Schedule::check(s);
    if (s.stages_per_rank != 2) throw ScheduleError("DualPipeV: exactly 2 stages per rank");
    if (s.microbatches < s.num_stages())
      throw ScheduleError("DualPipeV: needs at least as many microbatches as stages (" +
                          std::to_string(s.num_stages()) + "), got " + std::to_string(s.microbatches));
  }
  Program compute_actions(const ScheduleSpec& s) const override {
    Program p(s.pp);
    const int pp = s.pp, m = s.microbatches;
    for (int r = 0; r < pp; ++r) {
      auto& out = p[r];
      // Index 0: the rank's stage on the way down (r); 1: on the way back up (2p-1-r).
      const int stage[2] = {r, 2 * pp - 1 - r};
      int forwards[2] = {0, 0}, backwards[2] = {0, 0};
      std::vector<Action> deferred;  // W of earlier I's, oldest first
      size_t next_deferred = 0;
      using T = ActionType;
      auto forward = [&](int k) { out.push_back({stage[k], T::kForward, forwards[k]++}); };
      auto backward = [&](int k, bool split) {
        const int mb = backwards[k]++;
        out.push_back({stage[k], split ? T::kBackwardInput : T::kBackward, mb});
        if (split) deferred.push_back({stage[k], T::kBackwardWeight, mb});
      };
      auto deferred_weight = [&] {
        if (next_deferred < deferred.size()) out.push_back(deferred[next_deferred++]);
      };
      const int below = pp - 1 - r;  // ranks after this one on the way down
      for (int k = 0; k < 2 * below; ++k) forward(0);
      for (int k = 0; k <= r; ++k) forward(0), forward(1);
      for (int k = 0; k < below; ++k) backward(1, true), deferred_weight(), forward(1);
      // The steady state's pairs are overlap groups, as 2.15 marks them (all but the last rank's
      // first, which runs alone to shorten the bubble).
      auto with_previous = [&] { out.back().with_previous = true; };
      for (int k = 0; k < m - 2 * pp + r + 1; ++k) {
        forward(0), backward(1, false);
        if (k > 0 || r < pp - 1) with_previous();
        forward(1), backward(0, false), with_previous();
      }
      for (int k = 0; k < below; ++k) backward(1, false), forward(1), backward(0, false), with_previous();
      // Drain: full backwards, then I's from the middle on (odd ranks switch one action earlier).
      bool split = false;
      for (int k = 0; k <= r; ++k) {
        if (k == (r + 1) / 2 && r % 2 == 1) split = true;
        backward(1, split);
        if (k == (r + 1) / 2 && r % 2 == 0) split = true;
        backward(0, split);
      }
      for (int k = 0; k < below; ++k) deferred_weight(), backward(0, split);
      while (next_deferred < deferred.size()) deferred_weight();
    }
    return p;
  }
};

inline void register_builtin_schedules() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto add = [](const std::string& name, ScheduleFactory f) {
      std::lock_guard<std::mutex> lock(detail::registry_mutex());
      detail::registry().emplace(name, std::move(f));  // never replaces a user's schedule
    };
    add("GPipe", [] { return std::make_unique<GPipe>(); });
    add("1F1B", [] { return std::make_unique<OneFOneB>(); });
    add("LoopedBFS", [] { return std::make_unique<LoopedBFS>(); });
    add("Interleaved1F1B", [] { return std::make_unique<Interleaved1F1B>(false); });
    add("InterleavedZeroBubble", [] { return std::make_unique<Interleaved1F1B>(true); });
    add("ZBVZeroBubble", [] { return std::make_unique<ZBVZeroBubble>(); });
    add("DualPipeV", [] { return std::make_unique<DualPipeV>(); });
  });
}

}  // namespace fsdpp::pipeline
