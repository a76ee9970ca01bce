// The training loop: steps, progress and metrics, evaluation, checkpoints, the run's summary.
#include "fsdpp/train/trainer.hpp"

#include <fmt/format.h>
#include <sys/resource.h>

#include <csignal>
#include <fstream>
#include <iostream>

#include "fsdpp/base/mkl_dispatch.hpp"
#include "fsdpp/base/mkl_vml.hpp"
#include "fsdpp/base/openmp_wait.hpp"
#include "fsdpp/comm/fault.hpp"
#include "fsdpp/train/checkpoints.hpp"
#include "trainer_impl.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using detail::json;

namespace detail {

double peak_rss_mib() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

Resident resident_now() {
  Resident r;
  std::ifstream status("/proc/self/status");
  std::string key;
  double kib = 0;
  while (status >> key) {
    if (key == "RssAnon:" && status >> kib) r.own_mib = kib / 1024;
    if (key == "RssFile:" && status >> kib) r.file_mib = kib / 1024;
  }
  return r;
}

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

void maybe_fire(const char* kind, int rank, int64_t step) {
  if (!comm::injected_fault().due(kind, rank, step)) return;
  std::cerr << fmt::format("FSDPP_FAULT: rank {} kills itself ({} at step {})", rank, kind, step)
            << std::endl;
  raise(SIGKILL);
}

// On resume, the metrics up to the checkpoint are kept; what came after it is redone.
void Trainer::open_metrics(int64_t step) {
  const auto who = recipe_.logging.metrics;
  if (!(who == MetricsRanks::kAll || (who == MetricsRanks::kRank0 && lead()))) return;
  const auto path = out_ / "metrics" / fmt::format("rank{}.jsonl", rank_);
  std::vector<std::string> kept;
  if (options_.resume && fs::exists(path)) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      try {
        const auto j = json::parse(line);
        if (j.value("step", int64_t(0)) > step) continue;
        if (j.contains("loss")) train_series_.emplace_back(j["step"], j["loss"]);
        if (j.contains("val_loss")) val_series_.emplace_back(j["step"], j["val_loss"]);
        kept.push_back(line);
      } catch (const json::exception&) {
        // A line cut short by a crash.
      }
    }
  }
  metrics_ = std::make_unique<LineLog>(path, /*truncate=*/true);
  for (const auto& l : kept) metrics_->append(l);
}

// Every rank's spans of steps first..last, merged by rank 0 into trace.json.
void Trainer::write_trace(int64_t first, int64_t last, std::chrono::system_clock::time_point begin) {
  tracer_.add_communication(begin, std::chrono::system_clock::now());
  tracer_.set_active(false);
  fs::create_directories(out_ / "trace");
  tracer_.write((out_ / "trace" / fmt::format("rank{}.json", rank_)).string());
  world().barrier().wait();
  if (!lead()) return;
  std::vector<std::string> parts;
  for (int r = 0; r < world().size(); ++r)
    parts.push_back((out_ / "trace" / fmt::format("rank{}.json", r)).string());
  Tracer::merge(parts, (out_ / "trace.json").string());
  log(fmt::format("trace: {} (steps {}..{}; open in chrome://tracing or ui.perfetto.dev)",
                  (out_ / "trace.json").string(), first, last));
}

void Trainer::report_step(int64_t step, int64_t end, double loss, double tokens_per_s, double elapsed_s) {
  train_series_.emplace_back(step, loss);
  json m = {{"step", step},
            {"loss", loss},
            {"lr", last_stats_.lr},
            {"grad_norm", last_grad_norm_},
            {"tokens_per_s", tokens_per_s},
            {"time_s", elapsed_s}};
  if (recipe_.model.experts > 0)
    m.update({{"aux_loss", last_stats_.aux_loss},
              {"z_loss", last_stats_.z_loss},
              {"dropped_fraction", last_stats_.dropped}});
  metric(m);
  if (!lead()) return;
  const double tokens_per_step = double(recipe_.train.global_batch * recipe_.data.seq_len);
  const double eta = double(end - step) * tokens_per_step / std::max(tokens_per_s, 1e-9);
  std::string extra = fmt::format("lr {:.2e}", last_stats_.lr);
  if (recipe_.model.routing == "capacity")
    extra += fmt::format(" | dropped {:.1f}%", 100 * last_stats_.dropped);
  progress_.update(step, loss, tokens_per_s, eta, extra);
}

void Trainer::report_evaluation(int64_t step, RunResult& result) {
  result.val_loss = evaluate();
  val_series_.emplace_back(step, result.val_loss);
  json m = {{"step", step}, {"val_loss", result.val_loss}};
  if (val_bytes_per_token_ > 0) {
    result.val_bpb = bits_per_byte(result.val_loss);
    m["val_bpb"] = result.val_bpb;
  }
  metric(m);
  log(fmt::format("step {}: validation loss {:.4f} nats/token{}", step, result.val_loss,
                  val_bytes_per_token_ > 0 ? fmt::format(" ({:.3f} bits/byte)", result.val_bpb) : ""));
  if (lead() && recipe_.logging.plot)
    write_loss_svg((out_ / "loss.svg").string(), train_series_, val_series_,
                   fmt::format("{}: loss (nats per token)", recipe_.name));
}

void Trainer::write_summary(const RunResult& result, int64_t steps_run, double step_ms_median) {
  const json summary = {{"recipe", recipe_.name},
                        {"steps", result.steps_done},
                        {"steps_this_run", steps_run},
                        {"seconds", result.seconds},
                        {"tokens_per_s", result.tokens_per_s},
                        {"step_ms_median", step_ms_median},
                        {"train_loss", result.train_loss},
                        {"val_loss", result.val_loss},
                        {"val_bpb", val_bytes_per_token_ > 0 ? json(result.val_bpb) : json()},
                        {"tokenizer", recipe_.data.tokenizer},
                        {"dp", recipe_.parallel.dp},
                        {"pp", recipe_.parallel.pp},
                        {"dp_replicate", recipe_.parallel.dp_replicate},
                        {"ep", recipe_.parallel.ep},
                        {"parameter_mib", parameter_memory()},
                        {"restarts", options_.restart},
                        {"peak_rss_mib", peak_rss_mib()}};
  write_file_atomically((out_ / "summary.json").string(), summary.dump(1) + "\n");
  std::cout
      << fmt::format(
             "done: {} steps in {} ({:.1f}k tok/s); train loss {:.4f}, validation loss {:.4f} nats/token{}\n"
             "outputs: {}/ (loss.svg, metrics/, {}summary.json{})",
             steps_run, format_duration(result.seconds), result.tokens_per_s / 1e3, result.train_loss,
             result.val_loss,
             val_bytes_per_token_ > 0 ? fmt::format(" ({:.3f} bits/byte)", result.val_bpb) : "",
             out_.string(),
             recipe_.checkpoint.enabled ? fmt::format("checkpoints/{}, ", step_dir_name(result.steps_done))
                                        : "",
             options_.trace ? ", trace.json" : "")
      << std::endl;
}

RunResult Trainer::run() {
  log("MKL: " + mkl_dispatch().detail);  // Note [MKL's kernels on other vendors' CPUs]
  resolve_mkl_vml_kernels();             // Note [MKL vector math's first calls]: before any thread computes
  log("OpenMP: " + describe_openmp_wait(openmp_wait_environment()));
  prepare_output();
  build();
  if (options_.restart > 0)
    log(fmt::format("restart {}: {}", options_.restart,
                    options_.resume ? "continuing from the latest checkpoint that verifies"
                                    : "no checkpoint yet, starting afresh"));
  int64_t step = options_.resume ? restore() : 0;
  if (options_.resume && step >= recipe_.train.steps) {  // under another launcher than fsdpp run's
    log(fmt::format("the run is complete: step {} of {}; nothing was changed", step, recipe_.train.steps));
    RunResult done;
    done.output_dir = out_.string();
    done.steps_done = step;
    return done;
  }
  open_metrics(step);

  const int64_t end = std::min(recipe_.train.steps, options_.stop_after.value_or(recipe_.train.steps));
  const int64_t tokens_per_step = recipe_.train.global_batch * recipe_.data.seq_len;
  const int64_t trace_from = std::min(step + 1, end - 1), trace_to = trace_from + options_.trace_steps;
  log(fmt::format("training: steps {}..{} of {}, {} sequences x {} tokens per step; output in {}", step + 1,
                  end, recipe_.train.steps, recipe_.train.global_batch, recipe_.data.seq_len, out_.string()));
  RunResult result;
  result.output_dir = out_.string();
  std::vector<double> step_seconds;  // of every training step, for the summary's median
  std::chrono::system_clock::time_point trace_begin;
  const auto run_start = Clock::now();
  auto window_start = run_start;  // of the steps since the last report, for tokens/s
  int64_t window_steps = 0;
  const auto every = [&](int64_t interval) { return (interval > 0 && step % interval == 0) || step == end; };

  while (step < end) {
    if (options_.trace && step == trace_from) {
      tracer_.set_active(true);
      trace_begin = std::chrono::system_clock::now();
    }
    maybe_fire("kill", rank_, step + 1);
    const auto s0 = std::chrono::system_clock::now();
    const double loss = train_step(step);
    span(fmt::format("step {}", step + 1), "steps", s0);
    step_seconds.push_back(std::chrono::duration<double>(std::chrono::system_clock::now() - s0).count());
    ++step, ++window_steps;
    result.losses.push_back(loss);
    result.train_loss = loss;
    if (!std::isfinite(loss))
      throw std::runtime_error(
          fmt::format("step {}: the loss is {} (try a lower optim.lr or optim.grad_clip)", step, loss));

    if (options_.trace && tracer_.active() && (step >= trace_to || step == end))
      write_trace(trace_from + 1, step, trace_begin);
    if (every(recipe_.logging.interval)) {
      const double window_s = std::chrono::duration<double>(Clock::now() - window_start).count();
      report_step(step, end, loss, double(window_steps * tokens_per_step) / std::max(window_s, 1e-9),
                  std::chrono::duration<double>(Clock::now() - run_start).count());
      window_start = Clock::now();
      window_steps = 0;
    }
    if (every(recipe_.eval.interval)) {
      const auto e0 = std::chrono::system_clock::now();
      report_evaluation(step, result);
      span("eval", "steps", e0);
    }
    if (recipe_.checkpoint.enabled && every(recipe_.checkpoint.interval)) save_checkpoint(step);
  }

  progress_.finish();
  const auto steps_run = int64_t(step_seconds.size());
  result.steps_done = step;
  result.seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
  result.tokens_per_s = double(steps_run * tokens_per_step) / std::max(result.seconds, 1e-9);
  if (lead()) write_summary(result, steps_run, 1e3 * median(step_seconds));
  return result;
}

}  // namespace detail

RunResult run_training(const Recipe& recipe, comm::Comm world, const RunOptions& options) {
  if (world.size() != recipe.world_size())
    throw std::invalid_argument(fmt::format("{}: parallel: dp x pp = {} ranks, but the world has {}",
                                            recipe.source, recipe.world_size(), world.size()));
  detail::Trainer t(recipe, std::move(world), options);
  return t.run();
}

void check_output_dir(const Recipe& recipe, const RunOptions& options) {
  const auto out = recipe.output_dir();
  if (options.resume && options.overwrite)
    throw std::invalid_argument(
        "--resume and --overwrite contradict each other: --resume continues the run in " + out +
        ", --overwrite deletes it; give one");
  const auto all = committed_checkpoints(out);
  const auto latest = all.empty() ? std::nullopt : std::optional<std::string>(all.front());
  if (options.resume && !latest)
    throw std::runtime_error(fmt::format("--resume: no checkpoint under {}/checkpoints to resume from", out));
  if (options.resume) {
    // The latest checkpoint, as far as its record can be read (a damaged one is skipped, with a
    // message, when the ranks restore).
    json meta;
    try {
      meta = read_json_file((fs::path(*latest) / "trainer.json").string());
    } catch (const std::runtime_error&) {
      return;
    }
    detail::check_resume_settings(*latest, meta, recipe, options);
  }
  if (!options.resume && latest && !options.overwrite)
    throw std::runtime_error(
        fmt::format("{} already holds checkpoints (latest {}); pass --resume to continue that run "
                    "or --overwrite to start afresh",
                    out, fs::path(*latest).filename().string()));
}

std::optional<std::string> finished_run(const Recipe& recipe, const RunOptions& options) {
  if (!options.resume) return std::nullopt;
  const auto latest = latest_checkpoint(recipe.output_dir());
  if (!latest) return std::nullopt;
  try {
    const auto step = read_json_file((fs::path(*latest) / "trainer.json").string()).at("step").get<int64_t>();
    if (step < recipe.train.steps) return std::nullopt;
    verify_checkpoint(*latest);  // a damaged one is skipped by the ranks, which then train again
    return fmt::format(
        "{}: the run is complete (its latest checkpoint, {}, is step {} of {}); nothing "
        "was changed. To train further, raise train.steps with --resume-with-changes",
        recipe.output_dir(), fs::path(*latest).filename().string(), step, recipe.train.steps);
  } catch (const std::exception&) {
    return std::nullopt;  // the ranks' restore says what is wrong with it
  }
}

}  // namespace fsdpp::train
