#pragma once
// What a run shows and leaves behind: a progress bar (or plain lines when the output is not a
// terminal), an SVG plot of training and validation loss, and a Chrome trace of a few steps.

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp::train {

// "1:05", "1:02:03".
std::string format_duration(double seconds);

class Progress {
 public:
  // `tty`: redraw one line in place; otherwise print a line per update.
  Progress(int64_t total_steps, bool tty, std::ostream& out);
  // step is 1-based (steps done).
  void update(int64_t step, double loss, double tokens_per_s, double eta_s, const std::string& extra = "");
  // A line of its own (the bar is redrawn after it).
  void print(const std::string& line);
  void finish();

 private:
  int64_t total_;
  bool tty_;
  std::ostream& out_;
  std::string bar_;
};

using Series = std::vector<std::pair<int64_t, double>>;  // (step, value)

// A self-contained SVG line plot: training loss (line) and validation loss (line with dots) against
// steps, with labelled axes.
void write_loss_svg(const std::string& path, const Series& train, const Series& val,
                    const std::string& title);

// Spans of one rank's work, written as Chrome trace events ("X" events; pid = rank). Times are the
// system clock's; the rank's process_name entry also carries `monotonic_offset_us`, the system clock
// less the monotonic clock (std::chrono::steady_clock, CLOCK_MONOTONIC) when tracing was switched on,
// to place the spans on the clock that CPU rotation's periods follow.
class Tracer {
 public:
  using Clock = std::chrono::system_clock;
  explicit Tracer(int rank) : rank_(rank) {}
  bool active() const { return active_; }
  void set_active(bool on);
  void span(const std::string& name, const std::string& track, Clock::time_point begin,
            Clock::time_point end);
  // Adds the communication operations the flight recorders saw between `from` and `to`.
  void add_communication(Clock::time_point from, Clock::time_point to);
  void write(const std::string& path) const;
  // Merges per-rank trace files into one trace.
  static void merge(const std::vector<std::string>& inputs, const std::string& output);

 private:
  int rank_;
  bool active_ = false;
  int64_t monotonic_offset_us_ = 0;  // read whenever tracing is switched on
  std::vector<std::string> events_;  // serialised JSON objects
  std::vector<std::string> tracks_;
};

}  // namespace fsdpp::train
