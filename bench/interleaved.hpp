#pragma once
// Timing ways of doing the same work side by side: every round runs each way `per_round` times in
// turn, so that a machine's drift falls on all of them alike; medians over rounds, and ratios taken
// per round before their median. Each round starts one way further along the list, so that no way
// always runs in the same place (what the previous way left in the allocator and the caches moves a
// way's time by as much as 15% here), and each way's timed calls follow one untimed call of its own.

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fsdpp::bench {

struct Interleaved {
  std::map<std::string, std::vector<double>> ms;  // per way, milliseconds per call in each round

  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  }
  double median_ms(const std::string& way) const { return median(ms.at(way)); }
  // Median over rounds of ms(a) / ms(b): how many times faster b is than a.
  double ratio(const std::string& a, const std::string& b) const {
    std::vector<double> x;
    const auto &ta = ms.at(a), &tb = ms.at(b);
    for (size_t r = 0; r < ta.size(); ++r) x.push_back(ta[r] / tb[r]);
    return median(x);
  }
};

// Two warm-up calls per way, then `rounds` rounds.
inline Interleaved interleave(const std::vector<std::string>& order,
                              const std::function<void(const std::string&)>& call, int rounds,
                              int per_round) {
  using Clock = std::chrono::steady_clock;
  for (const auto& w : order) call(w), call(w);
  Interleaved out;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < order.size(); ++i) {
      const auto& w = order[(i + size_t(r)) % order.size()];
      call(w);
      const auto t0 = Clock::now();
      for (int k = 0; k < per_round; ++k) call(w);
      out.ms[w].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / per_round);
    }
  return out;
}

}  // namespace fsdpp::bench
