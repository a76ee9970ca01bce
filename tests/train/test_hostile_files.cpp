// The file rules of docs/cli.md against a hostile user, in real processes: a reader never blocks on
// a FIFO, a writer never follows a planted link, an output never replaces an input, every reader
// checks a checkpoint's checksums, and a finished run resumed changes nothing. Each bad input exits
// 2 with a message naming the path and what it is.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fsdpp/base/safetensors.hpp"
#include "train/hostile_helpers.hpp"
#include "train/run_helpers.hpp"

using namespace fsdpp::test;
namespace fs = std::filesystem;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// `fsdpp ARGS` under a timeout: a command that blocks on a FIFO is killed (124) instead of hanging
// the test.
Result cli(const std::string& args) { return sh("timeout 60 " + kBin + " " + args); }

void make_fifo(const std::string& path) {
  fs::remove(path);
  REQUIRE(mkfifo(path.c_str(), 0600) == 0);
}

// A finished run of the tiny recipe: 4 steps, checkpoints at 2 and 4.
std::string finished_run(const std::string& name) {
  const auto dir = fresh_dir(name);
  train_run(dir, "train.steps=4 checkpoint.interval=2 eval.interval=0 logging.interval=1");
  return dir;
}

const std::string kStep4 = "/checkpoints/step-00000004";

}  // namespace

TEST_CASE("run --resume of a finished run says it is complete and changes nothing") {
  const auto dir = finished_run("finished");
  const auto summary = read_text(dir + "/summary.json"), metrics = read_text(dir + "/metrics/rank0.jsonl");
  const auto r = sh(kBin + " run " + kRecipe + " logging.output_dir=" + dir +
                    " train.steps=4 checkpoint.interval=2 eval.interval=0 logging.interval=1 --resume");
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK(has(r.out, dir + ": the run is complete (its latest checkpoint, step-00000004, is step 4 of 4)"));
  CHECK_FALSE(has(r.out, "training: steps"));
  CHECK(read_text(dir + "/summary.json") == summary);
  CHECK(read_text(dir + "/metrics/rank0.jsonl") == metrics);
  fs::remove_all(dir);
}

TEST_CASE("ckpt consolidate never replaces what it reads, nor an existing file without --overwrite") {
  const auto dir = finished_run("consolidate-inputs");
  const auto out = dir + "/model.safetensors";
  for (const std::string target :
       {dir + kStep4 + "/rank0.safetensors", dir + kStep4 + "/trainer.json", dir + "/checkpoints/latest",
        dir + "/checkpoints/step-00000002/rank0.json"}) {
    CAPTURE(target);
    const auto before = read_text(target);
    const auto r = cli("ckpt consolidate " + dir + " -o " + target + " --overwrite");
    INFO(r.out);
    CHECK(r.rc == 2);
    CHECK(has(r.out, "which this command reads: write the output elsewhere"));
    CHECK(read_text(target) == before);
  }
  CHECK(sh(kBin + " ckpt verify " + dir).rc == 0);
  REQUIRE(cli("ckpt consolidate " + dir + " -o " + out).rc == 0);
  const auto again = cli("ckpt consolidate " + dir + " -o " + out);
  INFO(again.out);
  CHECK(again.rc == 2);
  CHECK(has(again.out, out + " exists (a regular file): pass --overwrite to replace it"));
  CHECK(cli("ckpt consolidate " + dir + " -o " + out + " --overwrite").rc == 0);
  fs::remove_all(dir);
}

TEST_CASE("a planted link is never written through: the run lock, metrics and temporary files") {
  const auto dir = fresh_dir("planted-links");
  const auto victim = fresh_dir("victim-file");
  std::ofstream(victim) << "precious\n";
  fs::create_directories(dir);
  fs::create_symlink(victim, dir + "/.fsdpp-run.lock");
  const auto r = cli("run " + kRecipe + " logging.output_dir=" + dir + " train.steps=2");
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(has(r.out, dir + "/.fsdpp-run.lock is a symbolic link: fsdpp writes no file through a link"));
  CHECK(read_text(victim) == "precious\n");
  fs::remove(dir + "/.fsdpp-run.lock");
  make_fifo(dir + "/.fsdpp-run.lock");
  const auto f = cli("run " + kRecipe + " logging.output_dir=" + dir + " train.steps=2");
  INFO(f.out);
  CHECK(f.rc == 2);
  CHECK(has(f.out, dir + "/.fsdpp-run.lock is a FIFO, not a regular file"));
  fs::remove(dir + "/.fsdpp-run.lock");

  // A finished run whose metrics file, and the temporary name of its summary, became links.
  train_run(dir, "train.steps=2 checkpoint.interval=2 eval.interval=0");
  fs::remove(dir + "/metrics/rank0.jsonl");
  fs::create_symlink(victim, dir + "/metrics/rank0.jsonl");
  const auto m = cli("run " + kRecipe + " logging.output_dir=" + dir +
                     " train.steps=3 checkpoint.interval=2 eval.interval=0 --resume-with-changes");
  INFO(m.out);
  CHECK(m.rc != 0);
  CHECK(has(m.out, dir + "/metrics/rank0.jsonl is a symbolic link"));
  CHECK(read_text(victim) == "precious\n");
  fs::remove(dir + "/metrics/rank0.jsonl");
  fs::create_symlink(victim, dir + "/summary.json.tmp");
  CHECK(cli("run " + kRecipe + " logging.output_dir=" + dir +
            " train.steps=3 checkpoint.interval=2 eval.interval=0 --resume-with-changes")
            .rc == 0);
  CHECK(read_text(victim) == "precious\n");
  CHECK(fs::is_regular_file(fs::symlink_status(dir + "/summary.json")));
  fs::remove_all(dir);
  fs::remove(victim);
}

TEST_CASE(
    "a FIFO where a file belongs is refused at once, naming it: schedule tables, checkpoints, "
    "transformers directories") {
  const auto dir = fresh_dir("fifos");
  fs::create_directories(dir);
  const auto t0 = std::chrono::steady_clock::now();

  make_fifo(dir + "/table.csv");
  const auto show = cli("schedule show --csv " + dir + "/table.csv --pp 2 --microbatches 4");
  INFO(show.out);
  CHECK(show.rc == 2);
  CHECK(has(show.out, "schedule table " + dir + "/table.csv is a FIFO, not a regular file"));
  const auto run = cli("validate " + kRecipe + " parallel.pp=2 parallel.schedule=" + dir + "/table.csv");
  INFO(run.out);
  CHECK(run.rc == 2);
  CHECK(has(run.out, "schedule table " + dir + "/table.csv is a FIFO, not a regular file"));

  const auto ckpt = finished_run("fifo-ckpt");
  make_fifo(ckpt + kStep4 + "/trainer.json");
  const auto verify = cli("ckpt verify " + ckpt);
  INFO(verify.out);
  CHECK(verify.rc == 1);
  CHECK(has(verify.out, ckpt + kStep4 + "/trainer.json is a FIFO, not a regular file"));
  CHECK(has(verify.out, ckpt + "/checkpoints/step-00000002: ok"));
  // A checkpoint with such a record is damaged, as verify says: exit 1 (docs/cli.md).
  const auto gen = cli("generate " + ckpt + " --prompt x --tokens 2");
  INFO(gen.out);
  CHECK(gen.rc == 1);
  CHECK(has(gen.out, "trainer.json is a FIFO, not a regular file"));
  make_fifo(ckpt + "/checkpoints/latest");
  const auto verify_latest = cli("ckpt verify " + ckpt + "/checkpoints/latest");
  INFO(verify_latest.out);
  CHECK(verify_latest.rc == 2);

  // A transformers directory whose config.json is a FIFO.
  const auto hf = dir + "/hf";
  fs::create_directories(hf);
  make_fifo(hf + "/config.json");
  std::ofstream(hf + "/model.safetensors") << "x";
  for (const std::string cmd :
       {"import " + hf + " -o " + dir + "/imported.safetensors", "generate " + hf + " --prompt x --tokens 2",
        "validate " + kRecipe + " model.init_from=" + hf}) {
    CAPTURE(cmd);
    const auto r = cli(cmd);
    INFO(r.out);
    CHECK(r.rc == 2);
    CHECK(has(r.out, hf + "/config.json is a FIFO, not a regular file"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120));  // nothing waited on a FIFO
  fs::remove_all(dir);
  fs::remove_all(ckpt);
}

TEST_CASE("every reader of a checkpoint checks its checksums: consolidate, export and generate") {
  const auto dir = finished_run("crc-readers");
  // One byte of rank 0's index changed: its CRC no longer matches what trainer.json records.
  const auto index = dir + kStep4 + "/rank0.json";
  auto text = read_text(index);
  const auto at = text.find("\"shape\"");
  REQUIRE(at != std::string::npos);
  text.replace(at, 7, "\"Shape\"");
  std::ofstream(index, std::ios::trunc) << text;
  for (const std::string cmd :
       {"ckpt consolidate " + dir + " -o " + dir + "/model.safetensors",
        "export " + dir + " -o " + dir + "/exported --format hf", "generate " + dir + " --prompt x"}) {
    CAPTURE(cmd);
    const auto r = cli(cmd);
    INFO(r.out);
    CHECK(r.rc != 0);
    CHECK(has(r.out, index + " is damaged"));
  }
  CHECK_FALSE(fs::exists(dir + "/model.safetensors"));
  CHECK_FALSE(fs::exists(dir + "/exported"));
  fs::remove_all(dir);
}

TEST_CASE("schedule show and run refuse a step too large to plan, at once, naming the limit") {
  const auto t0 = std::chrono::steady_clock::now();
  for (const std::string args : {"--schedule 1F1B --pp 1024 --microbatches 2048",
                                 "--schedule DualPipeV --pp 2 --microbatches 100000 --fsdp",
                                 "--schedule 1F1B --pp 2 --microbatches 100000"}) {
    CAPTURE(args);
    const auto r = cli("schedule show " + args);
    INFO(r.out);
    CHECK(r.rc == 2);
    CHECK(has(r.out, "is past what a plan holds"));
  }
  const auto v = cli("validate " + kRecipe +
                     " model.layers=4 parallel.pp=2 parallel.microbatches=65536 train.global_batch=65536");
  INFO(v.out);
  CHECK(v.rc == 2);
  CHECK(has(v.out, "is past what a plan holds"));
  // The largest steps that are planned take seconds, not minutes.
  const auto big = cli("schedule show --schedule 1F1B --pp 2 --microbatches 4096");
  CHECK(big.rc == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));
}

TEST_CASE(
    "a transformers config.json's problems are named by its own fields, and the weights' NaN by tensor") {
  const auto dir = fresh_dir("hf-fields");
  const auto hf = dir + "/hf";
  fs::create_directories(hf);
  std::ofstream(hf + "/model.safetensors") << "x";
  const auto validate = [&](const std::string& config, const std::string& args = "") {
    std::ofstream(hf + "/config.json", std::ios::trunc) << config;
    return cli("validate " + kRecipe + " model.init_from=" + hf + " " + args);
  };
  const std::string llama =
      R"("vocab_size": 256, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2)";
  auto r = validate(R"({"model_type": "llama", "hidden_size": -32, )" + llama + "}");
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(has(r.out, "hidden_size: must be in"));
  CHECK_FALSE(has(r.out, " dim:"));
  r = validate(R"({"model_type": "llama", "architectures": ["MixtralForCausalLM"], "hidden_size": 32, )" +
               llama + "}");
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(has(r.out, R"(architectures ["MixtralForCausalLM"]: model_type "llama" is LlamaForCausalLM)"));
  // A Mixtral has no dense width: the recipe's model.ffn_hidden is not compared with fsdpp's default.
  r = validate(
      R"({"model_type": "mixtral", "hidden_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, )" +
          llama + "}",
      "model.ffn_hidden=64");
  INFO(r.out);
  CHECK_FALSE(has(r.out, "ffn_hidden"));
  // The tiny recipe's Llama-sized dims differ from the file's: named with the file's field.
  r = validate(R"({"model_type": "llama", "hidden_size": 48, )" + llama + "}");
  INFO(r.out);
  CHECK(has(r.out, "model.dim: 32 here, but the transformers checkpoint " + hf + " has hidden_size 48"));

  // Weights that hold NaN: refused where they are read, naming the tensor.
  const auto run = dir + "/run";
  train_run(run, "train.steps=2 checkpoint.interval=2 eval.interval=0");
  REQUIRE(cli("ckpt consolidate " + run + " -o " + dir + "/good.safetensors").rc == 0);
  auto file = fsdpp::read_safetensors(dir + "/good.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors(file.tensors.begin(), file.tensors.end());
  tensors[1].second = tensors[1].second.clone();
  tensors[1].second.view(-1)[0] = std::nan("");
  fsdpp::write_safetensors(dir + "/nan.safetensors", tensors, file.metadata);
  const auto gen = cli("generate " + dir + "/nan.safetensors --prompt x --tokens 2");
  INFO(gen.out);
  CHECK(gen.rc != 0);
  CHECK(has(gen.out, "tensor " + tensors[1].first + " holds 1 values (NaN or infinite)"));
  const auto init = sh(kBin + " run " + kRecipe + " logging.output_dir=" + dir +
                       "/run2 train.steps=2 model.init_from=" + dir + "/nan.safetensors");
  INFO(init.out);
  CHECK(init.rc != 0);
  CHECK(has(init.out, "tensor " + tensors[1].first + " holds 1 values (NaN or infinite)"));
  CHECK_FALSE(has(init.out, "learning rate"));
  fs::remove_all(dir);
}

TEST_CASE("inputs once accepted in silence are refused or noted, with exit 2 and no library's internals") {
  const auto dir = fresh_dir("silent");
  const auto run = dir + "/run";
  train_run(run, "train.steps=2 checkpoint.interval=2 eval.interval=0");
  struct Case {
    std::string args, says;
  };
  for (const auto& c : std::vector<Case>{
           {"generate " + run + " --prompt x --seed 9223372036854775808",
            "9223372036854775808 is not a whole number from 0 to 2^63 - 1"},
           {"export " + run + " -o " + dir + "/big --format hf --max-shard-size 20000000000000000000",
            "is past 2^63 bytes"},
           {"schedule show --schedule 1F1B --unshard-lookahead 1,2", "--unshard-lookahead requires --fsdp"},
           {"launch --nproc 1 -- /nonexistent/prog", "program /nonexistent/prog: No such file or directory"},
           {"launch --nproc 1 -- " + kRecipe, "is not executable"},
           {"tokenizer train " + std::string(FSDPP_SOURCE_DIR) + "/docs -o " + dir + "/t.model --vocab 300",
            "is too small for this text, whose characters need"}}) {
    CAPTURE(c.args);
    const auto r = cli(c.args);
    INFO(r.out);
    CHECK(r.rc == 2);
    CHECK(has(r.out, c.says));
    CHECK_FALSE(has(r.out, ".cc("));
  }
  std::ofstream(dir + "/garbage.model") << "not a model";
  const auto t = cli("tokenize " + std::string(FSDPP_SOURCE_DIR) + "/README.md -o " + dir +
                     "/shards --tokenizer " + dir + "/garbage.model");
  INFO(t.out);
  CHECK(t.rc == 2);
  CHECK(has(t.out, "not a SentencePiece model (its bytes do not parse as one)"));
  const auto fault = sh("FSDPP_FAULT=kill:rank=0:step=50 " + kBin + " run " + kRecipe +
                        " logging.output_dir=" + dir + "/faulty train.steps=4");
  INFO(fault.out);
  CHECK(fault.rc == 2);
  CHECK(has(fault.out, "step 50 is past the run's last step (4): the fault would never fire"));
  // A transformers directory whose tokenizer fsdpp cannot read: imported without one, saying why.
  REQUIRE(cli("export " + run + " -o " + dir + "/hf --format hf").rc == 0);
  std::ofstream(dir + "/hf/tokenizer.json", std::ios::trunc) << "{garbage";
  const auto imp = cli("import " + dir + "/hf -o " + dir + "/imported.safetensors");
  INFO(imp.out);
  CHECK(imp.rc == 0);
  CHECK(has(imp.out,
            "fsdpp import: note: no tokenizer taken: " + dir + "/hf/tokenizer.json is not valid JSON"));
  fs::remove_all(dir);
}

TEST_CASE("a checkpoint that fails on a full disk leaves no temporary directory behind") {
  SmallDisk disk("ckpt-disk", "4m");
  if (!disk.mounted) {
    WARN_MESSAGE(false, "cannot mount a tmpfs here (needs root): the full-disk checkpoint case did not run");
    return;
  }
  const auto dir = disk.path + "/run";
  disk.fill(/*spare=*/256 << 10);  // room for the run's small files, not for a checkpoint (about 0.6 MB)
  const auto r = cli("run " + kRecipe + " logging.output_dir=" + dir +
                     " train.steps=4 checkpoint.interval=2 eval.interval=0 logging.plot=false");
  INFO(r.out);
  CHECK(r.rc != 0);
  CHECK(has(r.out, "(ENOSPC)"));
  CHECK(temporary_files(dir).empty());
}
