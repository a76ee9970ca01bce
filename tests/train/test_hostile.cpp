// `fsdpp` against a hostile user and a hostile machine, in real processes: what a run owns is never
// lost (its output directory, every metrics line, its checkpoints' meaning), and failures end in a
// message that names the file, key or rank at fault.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "fsdpp/train/run_lock.hpp"
#include "train/hostile_helpers.hpp"
#include "train/run_helpers.hpp"

using namespace fsdpp;
using namespace fsdpp::test;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Starts `cmd` in the background (its own process group); returns its pid.
pid_t start(const std::string& cmd, const std::string& log) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", ("exec " + cmd + " > " + log + " 2>&1").c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Waits until `done` holds, up to `seconds`.
bool wait_for(const std::function<bool()>& done, double seconds = 60) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

size_t metric_lines(const std::string& dir) {
  std::ifstream f(fs::path(dir) / "metrics" / "rank0.jsonl");
  size_t n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}

// Every line of the run's metrics is a whole JSON record, and the training steps follow each other.
void check_metrics_whole(const std::string& dir) {
  const auto text = read_text((fs::path(dir) / "metrics" / "rank0.jsonl").string());
  CHECK((text.empty() || text.back() == '\n'));
  std::istringstream in(text);
  int64_t last = 0;
  for (std::string line; std::getline(in, line);) {
    INFO(line);
    json j;
    CHECK_NOTHROW(j = json::parse(line));
    if (j.contains("loss")) {
      CHECK(j["step"].get<int64_t>() == last + 1);
      last = j["step"];
    }
  }
}

}  // namespace

TEST_CASE(
    "run: a second run into the same output directory is refused, naming the first; the first's outputs "
    "stay whole; a claim left by a killed run is taken over with a note") {
  const auto dir = fresh_dir("claimed");
  const auto log_a = dir + ".a.log";
  const pid_t a = start(kBin + " run " + kRecipe + " logging.output_dir=" + dir +
                            " train.steps=400 logging.interval=1 eval.interval=0 checkpoint.interval=100",
                        log_a);
  const auto lock_file = dir + "/" + train::RunLock::kFileName;
  REQUIRE(wait_for(
      [&] { return fs::exists(lock_file) && fs::file_size(lock_file) > 0 && metric_lines(dir) > 3; }));
  const auto b = sh(kBin + " run " + kRecipe + " logging.output_dir=" + dir + " train.seed=99 --overwrite");
  INFO(b.out);
  CHECK(b.rc != 0);
  CHECK(b.out.find(dir + " is in use by another run: pid " + std::to_string(a)) != std::string::npos);
  CHECK(b.out.find("started 20") != std::string::npos);
  CHECK(b.out.find("logging.output_dir") != std::string::npos);
  const int rc = wait_exit(a);
  INFO(read_text(log_a));
  CHECK(rc == 0);
  CHECK(losses(dir).size() == 400);  // every step of the first run, none of the second's
  check_metrics_whole(dir);
  CHECK(fs::file_size(lock_file) == 0);  // released at the end

  // A run killed while holding the claim leaves its record; the next run takes it over.
  std::ofstream(lock_file)
      << R"({"pid": 999999, "host": "gone", "started": "2026-01-02 03:04:05 UTC", "command": "fsdpp run x"})"
      << "\n";
  const auto c = sh(kBin + " run " + kRecipe + " logging.output_dir=" + dir + " train.steps=2 --overwrite");
  INFO(c.out);
  CHECK(c.rc == 0);
  CHECK(c.out.find("taking over the claim of a run that ended without releasing it (pid 999999 on host gone, "
                   "started 2026-01-02 03:04:05 UTC") != std::string::npos);
  fs::remove_all(dir);
  fs::remove(log_a);
}

TEST_CASE(
    "run: resuming with settings the checkpoint's data order or optimizer depend on is refused, naming "
    "each; --resume-with-changes continues and logs them; --resume with --overwrite is refused") {
  const auto dir = fresh_dir("resume-changes");
  const std::string common = " train.steps=10 checkpoint.interval=5 eval.interval=0 logging.interval=1";
  train_run(dir, common + " --stop-after 5");
  for (const auto& [change, named] : std::vector<std::pair<std::string, std::string>>{
           {"train.seed=7", "train.seed: 1234 -> 7"},
           {"train.global_batch=16", "train.global_batch: 8 -> 16"},
           {"optim.lr=0.5", "optim.lr: 0.01 -> 0.5"},
           {"data.seq_len=16", "data.seq_len: 32 -> 16"}}) {
    CAPTURE(change);
    const auto r =
        sh(kBin + " run " + kRecipe + " logging.output_dir=" + dir + common + " " + change + " --resume");
    INFO(r.out);
    CHECK(r.rc != 0);
    CHECK(r.out.find("--resume: " + dir + "/checkpoints/step-00000005 was written with other settings") !=
          std::string::npos);
    CHECK(r.out.find(named) != std::string::npos);
    CHECK(r.out.find("--resume-with-changes") != std::string::npos);
  }
  CHECK(losses(dir).size() == 5);  // nothing ran
  // Layout is free to change: dp 2 with half the accumulation resumes.
  const auto out = train_run(dir, common + " train.seed=7 --resume-with-changes");
  CHECK(out.find("--resume-with-changes: continuing " + dir +
                 "/checkpoints/step-00000005 with train.seed: 1234 -> 7") != std::string::npos);
  CHECK(losses(dir).size() == 10);
  const auto both =
      sh(kBin + " run " + kRecipe + " logging.output_dir=" + dir + common + " --resume --overwrite");
  CHECK(both.rc != 0);
  CHECK(both.out.find("--resume and --overwrite contradict each other") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("run: a checkpoint without its trainer.json is damaged: `ckpt verify` says so, --resume skips it") {
  const auto dir = fresh_dir("no-record");
  train_run(dir, "train.steps=10 checkpoint.interval=5 eval.interval=0");
  const auto newest = dir + "/checkpoints/step-00000010";
  fs::remove(newest + "/trainer.json");
  const auto v = sh(kBin + " ckpt verify " + dir);
  INFO(v.out);
  CHECK(v.rc == 1);
  CHECK(v.out.find(newest + ": DAMAGED: checkpoint: " + newest + "/trainer.json is missing") !=
        std::string::npos);
  CHECK(v.out.find(dir + "/checkpoints/step-00000005: ok") != std::string::npos);
  const auto r = train_run(dir, "train.steps=12 checkpoint.interval=5 eval.interval=0 --resume-with-changes");
  CHECK(r.find("--resume: skipping " + newest) != std::string::npos);
  CHECK(r.find("resumed from " + dir + "/checkpoints/step-00000005") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE(
    "run: a full disk stops the run with an error naming the file and ENOSPC; every metrics line is whole "
    "and no temporary file is left") {
  SmallDisk disk("full-disk");
  if (!disk.mounted) {
    WARN_MESSAGE(false, "cannot mount a tmpfs here (needs root): the full-disk cases did not run");
    return;
  }
  const auto dir = disk.path + "/run";
  const auto log = disk.path + ".log";
  const pid_t run = start(kBin + " run " + kRecipe + " logging.output_dir=" + dir +
                              " train.steps=2000 logging.interval=1 eval.interval=0 checkpoint.interval=0",
                          log);
  REQUIRE(wait_for([&] { return metric_lines(dir) > 5; }));
  const auto filler = disk.fill();  // full for a few seconds, then free again
  std::this_thread::sleep_for(std::chrono::seconds(2));
  fs::remove(filler);
  const int rc = wait_exit(run);
  const auto out = read_text(log);
  INFO(out);
  CHECK(rc != 0);
  CHECK(out.find("writing " + dir + "/metrics/rank0.jsonl failed: No space left on device (ENOSPC)") !=
        std::string::npos);
  check_metrics_whole(dir);
  CHECK(temporary_files(dir).empty());
  fs::remove(log);

  // Writers of whole files: a consolidated checkpoint and token shards.
  const auto ok = fresh_dir("full-disk-source");
  train_run(ok, "train.steps=2 checkpoint.interval=2 eval.interval=0");
  const auto filler2 = disk.fill();
  const auto c = sh(kBin + " ckpt consolidate " + ok + " -o " + disk.path + "/model.safetensors");
  INFO(c.out);
  CHECK(c.rc != 0);
  CHECK(c.out.find("writing " + disk.path + "/model.safetensors failed") != std::string::npos);
  CHECK(c.out.find("(ENOSPC)") != std::string::npos);
  CHECK_FALSE(fs::exists(disk.path + "/model.safetensors"));
  CHECK(temporary_files(disk.path).empty());
  const auto t = sh(kBin + " tokenize " + std::string(FSDPP_SOURCE_DIR) + "/README.md " +
                    std::string(FSDPP_SOURCE_DIR) + "/docs -o " + disk.path + "/shards");
  INFO(t.out);
  CHECK(t.rc != 0);
  CHECK(t.out.find("(ENOSPC)") != std::string::npos);
  CHECK(temporary_files(disk.path).empty());
  fs::remove(filler2);
  fs::remove_all(ok);
}

TEST_CASE(
    "fsdpp: bad options exit 2 with a short message naming the option; recipe errors exit 2; failures 1") {
  const auto nproc = sh(kBin + " launch --nproc 0 -- true");
  CHECK(nproc.rc == 2);
  CHECK(nproc.out.find("--nproc: Value 0 not in range 1 to 65536") != std::string::npos);
  CHECK(nproc.out.size() < 200);
  CHECK(sh(kBin + " run " + kRecipe + " --no-such-option").rc == 2);
  CHECK(sh(kBin + " run " + kRecipe + " train.steps=0").rc == 2);
  const auto dir = fresh_dir("generate-options");
  train_run(dir, "train.steps=3 eval.interval=0 checkpoint.interval=3");
  for (const auto& [args, named] :
       std::vector<std::pair<std::string, std::string>>{{"--seed -1", "--seed"},
                                                        {"--temperature nan", "--temperature"},
                                                        {"--temperature inf", "--temperature"},
                                                        {"--temperature -0.5", "--temperature"},
                                                        {"--tokens 0", "--max-new-tokens"},
                                                        {"--top-p 0", "--top-p"},
                                                        {"--top-p 1.5", "--top-p"},
                                                        {"--stop", "--stop"}}) {
    CAPTURE(args);
    const auto r = sh(kBin + " generate " + dir + " " + args);
    CHECK(r.rc == 2);
    CHECK(r.out.find(named) != std::string::npos);
    CHECK(r.out.find("Exception raised from") == std::string::npos);
  }
  // A temperature far below any logit gap (a subnormal number) samples as greedy does.
  const auto tiny = sh(kBin + " generate " + dir + " --prompt ab --tokens 12 --temperature 1e-310 --seed 3");
  const auto greedy = sh(kBin + " generate " + dir + " --prompt ab --tokens 12 --temperature 0");
  INFO(tiny.out);
  CHECK(tiny.rc == 0);
  CHECK(tiny.out == greedy.out);
  const auto missing = sh(kBin + " generate " + dir + "/nothing-here");
  CHECK(missing.rc == 2);
  fs::remove_all(dir);
}

TEST_CASE(
    "fsdpp: `schedule show` prints, and writes files only with --out; V schedules take 2 stages per rank") {
  const auto dir = fresh_dir("show");
  fs::create_directories(dir);
  const auto r =
      sh("cd " + dir + " && " + kBin + " schedule show --schedule DualPipeV --pp 4 --microbatches 8");
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK(r.out.find("DualPipeV pp=4 stages/rank=2 microbatches=8") != std::string::npos);
  CHECK(fs::is_empty(dir));
  CHECK(sh("cd " + dir + " && " + kBin + " schedule show --schedule 1F1B --out s").rc == 0);
  for (const char* f : {"s.svg", "s.trace.json", "s.csv", "s.compute.csv"})
    CHECK(fs::exists(fs::path(dir) / f));
  fs::remove_all(dir);
}

TEST_CASE("fsdpp: `ckpt verify` follows checkpoints/latest, the pointer the run's tree shows") {
  const auto dir = fresh_dir("verify-latest");
  train_run(dir, "train.steps=4 eval.interval=0 checkpoint.interval=2");
  const auto r = sh(kBin + " ckpt verify " + dir + "/checkpoints/latest");
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK(r.out.find(dir + "/checkpoints/step-00000004: ok") != std::string::npos);
  std::ofstream(dir + "/checkpoints/latest") << "step-00000099\n";
  const auto bad = sh(kBin + " ckpt verify " + dir + "/checkpoints/latest");
  CHECK(bad.rc == 2);
  CHECK(bad.out.find("not a pointer to a checkpoint beside it (it names 'step-00000099')") !=
        std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE(
    "fsdpp: `tokenize` that refuses its corpus or fails leaves nothing new, and an earlier run's shards "
    "stay") {
  const auto dir = fresh_dir("tokenize-refused"), out = dir + "/shards";
  fs::create_directories(dir + "/two");
  std::ofstream(dir + "/two/a.txt") << "first document\n";
  std::ofstream(dir + "/two/b.txt") << "second document\n";
  std::ofstream(dir + "/one.txt") << "a single document\n";
  REQUIRE(sh(kBin + " tokenize " + dir + "/two -o " + out).rc == 0);
  const auto before = read_text(out + "/index.json");
  std::vector<std::string> shards_before;
  for (const auto& e : fs::directory_iterator(out)) shards_before.push_back(e.path().filename());
  std::sort(shards_before.begin(), shards_before.end());
  const auto r = sh(kBin + " tokenize " + dir + "/one.txt -o " + out);
  INFO(r.out);
  CHECK(r.rc != 0);
  CHECK(r.out.find("need at least 2 (one for validation)") != std::string::npos);
  std::vector<std::string> shards_after;
  for (const auto& e : fs::directory_iterator(out)) shards_after.push_back(e.path().filename());
  std::sort(shards_after.begin(), shards_after.end());
  CHECK(shards_after == shards_before);
  CHECK(read_text(out + "/index.json") == before);
  const auto fresh = dir + "/fresh";
  CHECK(sh(kBin + " tokenize " + dir + "/one.txt -o " + fresh).rc != 0);
  CHECK((!fs::exists(fresh) || fs::is_empty(fresh)));
  fs::remove_all(dir);
}

TEST_CASE("data: a FIFO, a directory or a device where a shard belongs is refused at once, naming it") {
  const auto dir = fresh_dir("fifo-shards");
  fs::create_directories(dir + "/text");
  for (int i = 0; i < 4; ++i)
    std::ofstream(fmt::format("{}/text/{}.txt", dir, i)) << "document number " << i << "\n";
  REQUIRE(sh(kBin + " tokenize " + dir + "/text -o " + dir + "/shards").rc == 0);
  const auto listed =
      json::parse(read_text(dir + "/shards/index.json"))["shards"][0]["file"].get<std::string>();
  const auto shard = dir + "/shards/" + listed;
  fs::remove(shard);
  REQUIRE(mkfifo(shard.c_str(), 0600) == 0);
  const std::string data = " data.source=shards data.path=" + dir + "/shards data.tokenizer=bytes";
  for (const std::string cmd : {" validate ", " run "}) {
    CAPTURE(cmd);
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = sh("timeout 60 " + kBin + cmd + kRecipe + data + " logging.output_dir=" + dir + "/run");
    INFO(r.out);
    CHECK(r.rc == 2);
    CHECK(r.out.find(shard + " is a FIFO, not a shard file (shards are regular files)") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  }
  // Without an index: a directory named like a shard is named, not skipped.
  fs::remove(shard);
  fs::remove(dir + "/shards/index.json");
  for (const auto& e : fs::directory_iterator(dir + "/shards")) fs::remove(e.path());
  fs::create_directories(dir + "/shards/tokens_train_000001.bin");
  std::ofstream(dir + "/shards/val.bin.keep");
  const auto r = sh(kBin + " validate " + kRecipe + data);
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("tokens_train_000001.bin is a directory, not a shard file") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE(
    "fsdpp: FSDPP_FAULT with a rank that is not a number or not in the world is refused before any rank "
    "starts") {
  for (const auto& [fault, said] : std::vector<std::pair<std::string, std::string>>{
           {"kill:rank=x:step=2", "(R and N whole numbers)"},
           {"kill:rank=3:step=2", "rank 3 is outside the world of 2 ranks (0 to 1)"},
           {"kill:rank=0:step=-1", "(R and N whole numbers)"}}) {
    CAPTURE(fault);
    const auto r =
        sh("FSDPP_FAULT=" + fault + " " + kBin + " run " + kRecipe + " parallel.dp=2 train.steps=2 " +
           "logging.output_dir=" + fresh_dir("fault") + " --overwrite");
    CHECK(r.rc == 2);
    CHECK(r.out.find(said) != std::string::npos);
    CHECK(r.out.find("[rank") == std::string::npos);  // no rank started
  }
}

TEST_CASE("fsdpp: MASTER_ADDR that cannot resolve fails at once, naming it") {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = sh("MASTER_ADDR=no-such-host.invalid MASTER_PORT=29411 RANK=1 WORLD_SIZE=2 " + kBin +
                    " run " + kRecipe + " parallel.dp=2 logging.output_dir=" + fresh_dir("no-host"));
  INFO(r.out);
  CHECK(r.rc == 1);
  CHECK(r.out.find("MASTER_ADDR='no-such-host.invalid' does not resolve") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE(
    "fsdpp: a recipe that cannot fit is refused with the estimate; a failed allocation is an error, not an "
    "abort") {
  const auto v = sh(kBin + " validate " + kRecipe + " train.global_batch=1099511627776");
  INFO(v.out);
  CHECK(v.rc == 2);
  CHECK(v.out.find("this recipe cannot fit: it needs an estimated") != std::string::npos);
  CHECK(v.out.find("activations") != std::string::npos);
  const std::string huge =
      " model.dim=4096 model.layers=512 model.experts=4096 model.expert_hidden=16384 model.heads=32";
  const auto run = sh(kBin + " run " + kRecipe + huge + " logging.output_dir=" + fresh_dir("huge"));
  CHECK(run.rc == 2);
  CHECK(run.out.find("this recipe cannot fit") != std::string::npos);
  // Past the launcher's check (a rank started by another launcher): LibTorch's allocator fails, and
  // the rank says so and exits 1, instead of aborting (Note [SentencePiece in its own lookup scope]).
  const auto rank = sh("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(29000 + getpid() % 2000) +
                       " RANK=0 WORLD_SIZE=1 " + kBin + " run " + kRecipe + huge +
                       " logging.output_dir=" + fresh_dir("huge"));
  INFO(rank.out);
  CHECK(rank.rc == 1);
  CHECK(rank.out.find("can't allocate memory") != std::string::npos);
  CHECK(rank.out.find("Exception raised from") == std::string::npos);
  fs::remove_all(fresh_dir("huge"));
}

TEST_CASE("fsdpp: a stopped rank is named as the likely cause, by the launcher and by `fr analyze`") {
  const auto dir = fresh_dir("stopped");
  const auto log = dir + ".log";
  const pid_t run = start(kBin + " run " + kRecipe +
                              " parallel.dp=2 train.steps=100000 logging.interval=1 eval.interval=0 " +
                              "checkpoint.interval=0 dist.watchdog_timeout_s=3 logging.output_dir=" + dir,
                          log);
  REQUIRE(wait_for([&] { return metric_lines(dir) > 3; }));
  // The ranks are the launcher's children; rank 1 is the second.
  const auto children = sh("pgrep -P " + std::to_string(run));
  std::vector<pid_t> ranks;
  std::istringstream in(children.out);
  for (pid_t p; in >> p;) ranks.push_back(p);
  std::sort(ranks.begin(), ranks.end());
  REQUIRE(ranks.size() == 2);
  ::kill(ranks[1], SIGSTOP);
  const int rc = wait_exit(run);
  const auto out = read_text(log);
  INFO(out);
  CHECK(rc == 124);
  CHECK(out.find("rank 0 (pid " + std::to_string(ranks[0]) +
                 ") exited with code 124: its watchdog ended it") != std::string::npos);
  CHECK(out.find("rank 1 (pid " + std::to_string(ranks[1]) + ") is stopped (SIGSTOP or a debugger)") !=
        std::string::npos);
  const auto fr = sh(kBin + " fr analyze " + dir + "/flight_records");
  INFO(fr.out);
  CHECK(fr.out.find("rank(s) 1 of 2 wrote no flight records") != std::string::npos);
  CHECK(fr.out.find("the likely culprit") != std::string::npos);
  fs::remove_all(dir);
  fs::remove(log);
}

TEST_CASE("rendezvous: a rank that waits says what for, how long, and the timeout") {
  const std::string port = std::to_string(29100 + getpid() % 500),
                    other = std::to_string(29700 + getpid() % 250);
  const std::string env = "env MASTER_ADDR=127.0.0.1 WORLD_SIZE=2 FSDPP_TEST_TIMEOUT_MS=11500 ";
  // Rank 0 hosts the store and waits for rank 1; a rank 1 elsewhere waits for a store nobody hosts.
  const auto log0 = fresh_dir("wait0.log"), log1 = fresh_dir("wait1.log");
  const pid_t host =
      start(env + "RANK=0 MASTER_PORT=" + port + " " + FSDPP_TEST_RANK_BIN + " collectives", log0);
  const pid_t client =
      start(env + "RANK=1 MASTER_PORT=" + other + " " + FSDPP_TEST_RANK_BIN + " collectives", log1);
  CHECK(wait_exit(host) != 0);
  CHECK(wait_exit(client) != 0);
  const auto out0 = read_text(log0), out1 = read_text(log1);
  INFO(out0);
  INFO(out1);
  CHECK(out0.find("fsdpp: rank 0 of 2: waiting for rank(s) 1 to join (10 s of 12 s)") != std::string::npos);
  CHECK(out1.find("fsdpp: waiting for the rendezvous store at 127.0.0.1:" + other + " (10 s of 12 s)") !=
        std::string::npos);
  fs::remove(log0);
  fs::remove(log1);
}
