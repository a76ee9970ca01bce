#pragma once
// Pictures of a simulated schedule: a terminal timeline, an SVG, and a Chrome trace (open it in
// Perfetto or chrome://tracing).

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "fsdpp/pipeline/simulator.hpp"

namespace fsdpp::pipeline {

namespace detail {

inline std::string label(const Action& a) {
  return std::string(type_token(a.type)) + std::to_string(a.microbatch);
}

inline const char* colour(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return "#4e79a7";
    case ActionType::kBackward:
      return "#e15759";
    case ActionType::kBackwardInput:
      return "#f28e2b";
    case ActionType::kBackwardWeight:
      return "#59a14f";
    default:
      return "#999999";
  }
}

}  // namespace detail

// One line per rank; `unit` time units per character cell of width 4. Idle time shows as dots.
inline std::string render_timeline(const SimResult& sim, double unit = 1) {
  const int cells = static_cast<int>(std::ceil(sim.makespan / unit));
  std::ostringstream out;
  for (size_t r = 0; r < sim.spans.size(); ++r) {
    std::string line(cells * 4, '.');
    for (const auto& s : sim.spans[r]) {
      const int a = static_cast<int>(std::lround(s.start / unit)) * 4;
      const int b = std::max(a + 4, static_cast<int>(std::lround(s.end / unit)) * 4);
      std::string text = std::to_string(s.action.stage) + detail::label(s.action);
      text.resize(b - a - 1, ' ');
      line.replace(a, b - a, "[" + text);
    }
    out << "rank " << r << " |" << line << "| bubble " << std::lround(sim.bubble[r] * 1000) / 10.0 << "%\n";
  }
  return out.str();
}

inline std::string render_svg(const SimResult& sim, const std::string& title) {
  const double scale = 40, row = 34, top = 30;
  const double width = sim.makespan * scale + 90, height = top + row * sim.spans.size() + 10;
  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"monospace\" font-size=\"11\">\n"
      << "<text x=\"4\" y=\"18\" font-size=\"13\">" << title << "</text>\n";
  for (size_t r = 0; r < sim.spans.size(); ++r) {
    const double y = top + r * row;
    out << "<text x=\"4\" y=\"" << y + 20 << "\">rank " << r << "</text>\n";
    for (const auto& s : sim.spans[r]) {
      const double x = 80 + s.start * scale, w = (s.end - s.start) * scale;
      out << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w - 1 << "\" height=\"" << row - 6
          << "\" fill=\"" << detail::colour(s.action.type) << "\"><title>" << to_string(s.action)
          << "</title></rect>\n"
          << "<text x=\"" << x + 3 << "\" y=\"" << y + 18 << "\" fill=\"white\">" << s.action.stage
          << detail::label(s.action) << "</text>\n";
    }
  }
  out << "</svg>\n";
  return out.str();
}

// Chrome trace events: one thread per rank, 1 time unit = 1 ms.
inline std::string chrome_trace(const SimResult& sim) {
  std::ostringstream out;
  out << "{\"traceEvents\":[";
  bool first = true;
  for (size_t r = 0; r < sim.spans.size(); ++r) {
    out << (first ? "" : ",") << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << r
        << ",\"args\":{\"name\":\"rank " << r << "\"}}";
    first = false;
    for (const auto& s : sim.spans[r])
      out << ",{\"name\":\"" << to_string(s.action) << "\",\"cat\":\"" << type_token(s.action.type)
          << "\",\"ph\":\"X\",\"pid\":0,\"tid\":" << r << ",\"ts\":" << s.start * 1000
          << ",\"dur\":" << (s.end - s.start) * 1000 << "}";
  }
  out << "]}\n";
  return out.str();
}

}  // namespace fsdpp::pipeline
