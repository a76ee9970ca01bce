#include "fsdpp/train/report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/base/files.hpp"

namespace fsdpp::train {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02}", t / 60, t % 60);
}

Progress::Progress(int64_t total, bool tty, std::ostream& out) : total_(total), tty_(tty), out_(out) {}

void Progress::update(int64_t step, double loss, double tps, double eta, const std::string& extra) {
  const std::string stats = fmt::format("loss {:.4f} | {:.1f}k tok/s | ETA {}{}", loss, tps / 1e3,
                                        format_duration(eta), extra.empty() ? "" : " | " + extra);
  if (!tty_) {
    out_ << fmt::format("step {}/{} | {}", step, total_, stats) << std::endl;
    return;
  }
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * std::min<double>(1.0, double(step) / double(total_)));
  bar_ = fmt::format("step {}/{} [{}{}] {}", step, total_, std::string(filled, '#'),
                     std::string(kWidth - filled, '.'), stats);
  // The cursor goes back to the start of the line after the bar, so that the next write replaces it.
  out_ << "\033[K" << bar_ << "\r" << std::flush;
}

void Progress::print(const std::string& line) {
  if (tty_) out_ << "\033[K";
  out_ << line << "\n";
  if (tty_ && !bar_.empty()) out_ << bar_ << "\r";
  out_ << std::flush;
}

void Progress::finish() {
  if (tty_ && !bar_.empty()) out_ << bar_ << "\n" << std::flush;
  bar_.clear();
}

namespace {

// 1, 2 or 5 times a power of ten, giving about `n` ticks over [lo, hi].
double nice_step(double lo, double hi, int n) {
  const double raw = std::max(hi - lo, 1e-12) / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

}  // namespace

void write_loss_svg(const std::string& path, const Series& train, const Series& val,
                    const std::string& title) {
  constexpr double W = 720, H = 420, L = 64, R = 20, T = 40, B = 48;
  int64_t x_max = 1;
  double y_lo = 1e300, y_hi = -1e300;
  for (const auto* s : {&train, &val})
    for (const auto& [x, y] : *s) {
      if (!std::isfinite(y)) continue;
      x_max = std::max(x_max, x);
      y_lo = std::min(y_lo, y);
      y_hi = std::max(y_hi, y);
    }
  if (y_lo > y_hi) y_lo = 0, y_hi = 1;
  const double ys = nice_step(y_lo, y_hi, 6);
  y_lo = std::floor(y_lo / ys) * ys;
  y_hi = std::ceil(y_hi / ys) * ys;
  if (y_hi <= y_lo) y_hi = y_lo + ys;
  const double xs = nice_step(0, double(x_max), 8);
  auto px = [&](double x) { return L + (W - L - R) * x / double(x_max); };
  auto py = [&](double y) { return T + (H - T - B) * (1 - (y - y_lo) / (y_hi - y_lo)); };

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" font-size=\"15\">{3}</text>\n",
      W, H, L, title);
  for (double y = y_lo; y <= y_hi + ys / 2; y += ys)
    svg += fmt::format(
        "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#ddd\"/>"
        "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:.4g}</text>\n",
        L, W - R, py(y), L - 6, py(y) + 4, y);
  for (double x = 0; x <= double(x_max) + xs / 2; x += xs)
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2}\" stroke=\"#eee\"/>"
        "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
        px(x), T, H - B, H - B + 16, static_cast<int64_t>(x));
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>\n",
                     L, T, W - L - R, H - T - B);
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2, H - 10);
  svg += fmt::format(
      "<text transform=\"translate(16 {}) rotate(-90)\" text-anchor=\"middle\">loss (nats per byte)</text>\n",
      (T + H - B) / 2);
  auto polyline = [&](const Series& s, const char* color) {
    std::string pts;
    for (const auto& [x, y] : s)
      if (std::isfinite(y)) pts += fmt::format("{:.1f},{:.1f} ", px(double(x)), py(y));
    return fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n", color,
                       pts);
  };
  svg += polyline(train, "#1f77b4");
  svg += polyline(val, "#d62728");
  for (const auto& [x, y] : val)
    if (std::isfinite(y))
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#d62728\"/>\n", px(double(x)),
                         py(y));
  svg += fmt::format(
      "<line x1=\"{0}\" x2=\"{1}\" y1=\"54\" y2=\"54\" stroke=\"#1f77b4\" stroke-width=\"2\"/>"
      "<text x=\"{2}\" y=\"58\">train</text>\n"
      "<line x1=\"{0}\" x2=\"{1}\" y1=\"72\" y2=\"72\" stroke=\"#d62728\" stroke-width=\"2\"/>"
      "<text x=\"{2}\" y=\"76\">validation</text>\n</svg>\n",
      W - R - 110, W - R - 90, W - R - 84);
  write_file_atomically(path, svg);
}

namespace {

int64_t micros(Tracer::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

}  // namespace

void Tracer::set_active(bool on) {
  if (on) {
    const auto system = Clock::now();
    const auto monotonic = std::chrono::steady_clock::now();
    monotonic_offset_us_ =
        micros(system) -
        std::chrono::duration_cast<std::chrono::microseconds>(monotonic.time_since_epoch()).count();
  }
  active_ = on;
}

void Tracer::span(const std::string& name, const std::string& track, Clock::time_point begin,
                  Clock::time_point end) {
  if (!active_) return;
  auto it = std::find(tracks_.begin(), tracks_.end(), track);
  if (it == tracks_.end()) it = tracks_.insert(tracks_.end(), track);
  const auto tid = it - tracks_.begin();
  events_.push_back(nlohmann::json{{"name", name},
                                   {"cat", track},
                                   {"ph", "X"},
                                   {"pid", rank_},
                                   {"tid", tid},
                                   {"ts", micros(begin)},
                                   {"dur", std::max<int64_t>(1, micros(end) - micros(begin))}}
                        .dump());
}

void Tracer::add_communication(Clock::time_point from, Clock::time_point to) {
  const bool was = active_;
  active_ = true;
  const auto comms = nlohmann::json::parse(comm::flight_records_json());
  for (const auto& c : comms)
    for (const auto& e : c.at("entries")) {
      const int64_t issued = e.at("issued_us");
      if (issued < micros(from) || issued > micros(to) || !e.contains("completed_us")) continue;
      const std::string label = e.at("label");
      const std::string name = e.at("op").get<std::string>() + (label.empty() ? "" : " " + label);
      span(name, "comm " + c.at("comm").get<std::string>(),
           Clock::time_point(std::chrono::microseconds(issued)),
           Clock::time_point(std::chrono::microseconds(e.at("completed_us").get<int64_t>())));
    }
  active_ = was;
}

void Tracer::write(const std::string& path) const {
  nlohmann::json meta = nlohmann::json::array();
  meta.push_back(
      {{"name", "process_name"},
       {"ph", "M"},
       {"pid", rank_},
       {"args", {{"name", fmt::format("rank {}", rank_)}, {"monotonic_offset_us", monotonic_offset_us_}}}});
  for (size_t i = 0; i < tracks_.size(); ++i)
    meta.push_back(
        {{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", i}, {"args", {{"name", tracks_[i]}}}});
  std::string text = "[";
  bool first = true;
  for (const auto& m : meta) text += (first ? "" : ",\n") + m.dump(), first = false;
  for (const auto& e : events_) text += (first ? "" : ",\n") + e, first = false;
  text += "]\n";
  write_file_atomically(path, text);
}

void Tracer::merge(const std::vector<std::string>& inputs, const std::string& output) {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& in : inputs) {
    std::ifstream f(in);
    for (auto& e : nlohmann::json::parse(f)) all.push_back(std::move(e));
  }
  write_file_atomically(output,
                        nlohmann::json{{"traceEvents", all}, {"displayTimeUnit", "ms"}}.dump() + "\n");
}

}  // namespace fsdpp::train
