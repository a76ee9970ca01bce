#include "data_commands.hpp"

#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "fsdpp/train/report.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::cli {

struct DataCommands {
  CLI::App* train = nullptr;
  CLI::App* tokenize = nullptr;
  train::TokenizerTrainOptions train_options;
  train::TokenizeOptions tokenize_options;
  std::string tokenizer = "bytes";
};

std::shared_ptr<DataCommands> add_data_commands(CLI::App& app) {
  auto c = std::make_shared<DataCommands>();
  auto* tok = app.add_subcommand("tokenizer", "tokenizers");
  tok->require_subcommand(1);
  c->train = tok->add_subcommand("train",
                                 "train a SentencePiece tokenizer (BPE or unigram) on text files: "
                                 "fsdpp tokenizer train --vocab 2048 INPUTS... -o tok.model");
  auto& t = c->train_options;
  c->train
      ->add_option("inputs", t.inputs,
                   "text files or directories (read recursively; binary files are skipped)")
      ->required()
      ->check(CLI::ExistingPath);
  c->train->add_option("-o,--output", t.output, "the .model file to write")->required();
  c->train->add_option("--vocab", t.vocab_size, "vocabulary size, with the 256 byte pieces")
      ->check(CLI::Range(260, 1 << 20));
  c->train->add_option("--type", t.type, "bpe or unigram")->check(CLI::IsMember({"bpe", "unigram"}));
  c->train
      ->add_option("--held-out", t.held_out,
                   "fraction of documents kept out of training, to measure bytes per token")
      ->check(CLI::Range(0.0, 0.5));
  c->train->add_option("--max-bytes", t.max_training_bytes, "train on at most this much text")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  c->train->add_option("--threads", t.threads, "training threads (0: all cores)")->check(CLI::Range(0, 4096));
  c->train->add_option("--seed", t.seed, "seed of the held-out draw (0 to 2^63 - 1)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{std::numeric_limits<int64_t>::max()}));

  c->tokenize = app.add_subcommand("tokenize",
                                   "write token shards (llm.c's .bin layout) for data.source \"shards\": "
                                   "fsdpp tokenize --tokenizer tok.model INPUTS... -o DIR");
  auto& k = c->tokenize_options;
  c->tokenize->add_option(
      "--tokenizer", c->tokenizer,
      "bytes (default), a SentencePiece .model, a tokenizer.json or a transformers directory");
  c->tokenize->add_option("inputs", k.inputs, "text files or directories; every file is a document")
      ->required()
      ->check(CLI::ExistingPath);
  c->tokenize
      ->add_option("-o,--output", k.output, "the directory of shards (new, empty, or an earlier run's)")
      ->required();
  c->tokenize->add_option("--shard-tokens", k.tokens_per_shard, "tokens per shard (llm.c: 100,000,000)")
      ->check(CLI::Range(int64_t{1}, int64_t{2147483647}));
  c->tokenize
      ->add_option("--val-fraction", k.val_fraction, "fraction of documents for validation (at least one)")
      ->check(CLI::Range(0.0, 0.5));
  c->tokenize->add_option("--name", k.name, "shard file prefix: NAME_train_000001.bin");
  c->tokenize->add_option("--seed", k.seed, "seed of the validation draw (0 to 2^63 - 1)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{std::numeric_limits<int64_t>::max()}));
  c->tokenize->add_option("--threads", k.threads, "encoding threads (0: all cores)")
      ->check(CLI::Range(0, 4096));
  auto* chat = c->tokenize->add_flag(
      "--chat", k.chat,
      "the inputs are JSONL conversations (as data.source \"chat\" reads), rendered with "
      "the tokenizer's chat template; shards for data.source \"chat\" with data.path, "
      "each with its loss mask beside it");
  c->tokenize
      ->add_option("--chat-template", k.chat_template,
                   "with --chat: a template file instead of the tokenizer's")
      ->check(CLI::ExistingFile)
      ->needs(chat);
  return c;
}

namespace {

// One line redrawn in place on a terminal; a line per tenth of the input otherwise.
class ByteProgress {
 public:
  explicit ByteProgress(std::string what) : what_(std::move(what)), tty_(::isatty(STDOUT_FILENO)) {}
  void update(const train::TokenizeProgress& p) {
    const double frac = p.bytes_total ? double(p.bytes_done) / double(p.bytes_total) : 1.0;
    const int tenth = static_cast<int>(frac * 10);
    if (!tty_ && tenth == last_tenth_ && frac < 1.0) return;
    last_tenth_ = tenth;
    const double mbs = double(p.bytes_done) / 1e6 / std::max(p.seconds, 1e-9);
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * frac);
    const std::string line = fmt::format(
        "{} [{}{}] {:3.0f}% {:.1f}/{:.1f} MB | {:.2f} MB/s | {:.2f} M tokens | {} shard{} | ETA {}", what_,
        std::string(filled, '#'), std::string(kWidth - filled, '.'), 100 * frac, p.bytes_done / 1e6,
        p.bytes_total / 1e6, mbs, p.tokens / 1e6, p.shards, p.shards == 1 ? "" : "s",
        train::format_duration(frac > 0 ? p.seconds * (1 - frac) / frac : 0));
    std::cout << (tty_ ? "\033[K" + line + "\r" : line + "\n") << std::flush;
  }
  void finish() {
    if (tty_) std::cout << "\n";
  }

 private:
  std::string what_;
  bool tty_;
  int last_tenth_ = -1;
};

int tokenizer_train(const DataCommands& c) {
  const auto r = train::train_tokenizer(
      c.train_options, [](const std::string& s) { std::cout << "tokenizer: " << s << std::endl; });
  std::cout << fmt::format(
      "wrote {}: {} {} pieces, trained on {:.2f} MB in {:.1f} s; {:.3f} bytes/token on {:.2f} MB held out\n",
      c.train_options.output, r.vocab_size, c.train_options.type, r.training_bytes / 1e6, r.seconds,
      r.bytes_per_token(), r.held_out_bytes / 1e6);
  return 0;
}

int tokenize(const DataCommands& c) {
  const auto tok = train::Tokenizer::load(c.tokenizer);
  ByteProgress bar("tokenize");
  const auto r = train::tokenize_to_shards(*tok, c.tokenize_options,
                                           [&](const train::TokenizeProgress& p) { bar.update(p); });
  bar.finish();
  const auto& k = c.tokenize_options;
  const int64_t bytes = r.train.bytes + r.val.bytes, tokens = r.train.tokens + r.val.tokens;
  const char* what = k.chat ? "conversations" : "documents";
  std::cout << fmt::format(
      "wrote {}/: train {} {}, {:.2f} M tokens in {} shard{}; validation {} {}, {:.2f} M "
      "tokens in {} shard{}\n{:.2f} MB in {:.1f} s ({:.2f} MB/s), {:.3f} bytes/token{}\n",
      k.output, r.train.documents, what, r.train.tokens / 1e6, r.train.shards, r.train.shards == 1 ? "" : "s",
      r.val.documents, what, r.val.tokens / 1e6, r.val.shards, r.val.shards == 1 ? "" : "s", bytes / 1e6,
      r.seconds, bytes / 1e6 / std::max(r.seconds, 1e-9),
      double(bytes) / double(std::max<int64_t>(1, tokens)),
      r.skipped_files ? fmt::format("; {} binary files skipped", r.skipped_files) : "");
  return 0;
}

}  // namespace

int run_data_commands(const DataCommands& c) {
  if (c.train->parsed()) return tokenizer_train(c);
  if (c.tokenize->parsed()) return tokenize(c);
  return -1;
}

}  // namespace fsdpp::cli
