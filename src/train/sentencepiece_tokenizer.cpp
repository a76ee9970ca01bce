// SentencePiece tokenizers (data.tokenizer set to a .model file, `fsdpp tokenizer train`): the
// plugin libfsdpp_sentencepiece.so, opened in a lookup scope of its own (Note [SentencePiece in its
// own lookup scope], piece_tokenizer.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"
#include "fsdpp/train/data.hpp"
#include "piece_tokenizer.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;

namespace {

// SentencePiece's message without its source location ("Internal: ./src/x.cc(1101) [check] ..."),
// which means nothing to a user of fsdpp, and with its advice in fsdpp's terms.
std::string user_text(const sentencepiece::util::Status& st) {
  std::string m = st.message();
  if (const auto close = m.find(") "); m.find(".cc(") != std::string::npos && close != std::string::npos)
    m = m.substr(close + 2);
  if (!m.empty() && m.front() == '[')
    if (const auto end = m.rfind("] "); end != std::string::npos) m = m.substr(end + 2);
  while (!m.empty() && m.back() == ' ') m.pop_back();
  if (m.empty()) return "its bytes do not parse as one";  // all SentencePiece said was where it failed
  int64_t have = 0, need = 0;
  if (std::sscanf(m.c_str(), "Vocabulary size is smaller than required_chars. %ld vs %ld", &have, &need) == 2)
    return fmt::format(
        "--vocab {} is too small for this text, whose characters need {} pieces; give a larger --vocab", have,
        need);
  return m;
}

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// Length of the valid UTF-8 sequence at s[i], 0 when the bytes there are not one.
size_t utf8_length(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n;
  uint32_t min;
  if (b < 0x80) return 1;
  if ((b & 0xE0) == 0xC0)
    n = 2, min = 0x80;
  else if ((b & 0xF0) == 0xE0)
    n = 3, min = 0x800;
  else if ((b & 0xF8) == 0xF0)
    n = 4, min = 0x10000;
  else
    return 0;
  if (i + n > s.size()) return 0;
  uint32_t cp = b & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if ((c & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (c & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

// Splits text into the runs SentencePiece may see (valid UTF-8 without newlines or U+2581), calling
// run(begin, end) for each and byte(b) for every byte between them, in order.
template <class Run, class Byte>
void split_for_pieces(std::string_view s, Run&& run, Byte&& byte) {
  size_t start = 0, i = 0;
  while (i < s.size()) {
    const size_t n = utf8_length(s, i);
    const bool own = n == 0 || s[i] == '\n' || s.substr(i, n) == kSpaceMark;
    if (!own) {
      i += n;
      continue;
    }
    if (i > start) run(s.substr(start, i - start));
    const size_t len = n == 0 ? 1 : n;
    for (size_t k = 0; k < len; ++k) byte(static_cast<unsigned char>(s[i + k]));
    i += len;
    start = i;
  }
  if (i > start) run(s.substr(start, i - start));
}

class PieceTokenizer final : public Tokenizer {
 public:
  explicit PieceTokenizer(const std::string& path) {
    spec_ = fs::absolute(path).lexically_normal().string();  // recorded, and found again from elsewhere
    require_regular_file(spec_, "tokenizer");  // Tokenizer::load has said why, where it was called
    hash_ = "crc32c:" + crc_hex(digest_file(path).crc32c);
    if (const auto st = sp_.Load(path); !st.ok())
      throw BadInput(fmt::format("tokenizer {}: not a SentencePiece model ({})", path, user_text(st)));
    const int n = sp_.GetPieceSize();
    text_.resize(static_cast<size_t>(n));
    byte_id_.fill(-1);
    for (int id = 0; id < n; ++id) {
      const std::string& piece = sp_.IdToPiece(id);
      if (sp_.IsByte(id)) {
        const auto b = static_cast<unsigned char>(std::stoi(piece.substr(3, 2), nullptr, 16));  // <0xNN>
        byte_id_[b] = id;
        text_[static_cast<size_t>(id)] = std::string(1, static_cast<char>(b));
      } else if (!sp_.IsControl(id) && !sp_.IsUnknown(id)) {
        auto& t = text_[static_cast<size_t>(id)];
        for (size_t i = 0; i < piece.size();) {
          if (std::string_view(piece).substr(i, 3) == kSpaceMark)
            t += ' ', i += 3;
          else
            t += piece[i++];
        }
      }
    }
    for (int b = 0; b < 256; ++b)
      if (byte_id_[static_cast<size_t>(b)] < 0)
        throw std::runtime_error(
            fmt::format("tokenizer {}: has no byte piece <0x{:02X}> (train it with byte fallback, "
                        "as `fsdpp tokenizer train` does)",
                        path, b));
    // Training data must come back as it went in. A model that normalizes text (NFKC, case), adds a
    // dummy prefix, drops extra spaces or has byte fallback switched off would change or lose text
    // without a word; this probe (every printable ASCII character, spaces at the ends and doubled,
    // letters NFKC maps elsewhere, a private-use character no model holds) finds each of those.
    std::string probe = "  ";
    for (char c = 0x21; c < 0x7F; ++c) probe += c;
    probe += "  a \xEF\xBC\xA1\xEF\xAC\x81 \xC3\xA9\xC3\x9F\xE4\xB8\xAD\xEE\x80\x80 ";
    if (const auto back = decode(encode(probe)); back != probe)
      throw std::runtime_error(fmt::format(
          "tokenizer {}: does not give back the text it encodes (a normalization rule, a dummy "
          "prefix, removed spaces or byte fallback switched off): \"{}\" came back as \"{}\"; fsdpp "
          "needs a model that keeps every text, as `fsdpp tokenizer train` makes",
          path, probe, back));
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int32_t eot() const override { return sp_.eos_id(); }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3);
    std::vector<int> ids;
    split_for_pieces(
        text,
        [&](std::string_view run) {
          if (const auto st = sp_.Encode(run, &ids); !st.ok())
            throw std::runtime_error(fmt::format("tokenizer {}: {}", spec_, user_text(st)));
          // SentencePiece writes spaces as U+2581 before it falls back to bytes, so a model without
          // a piece for U+2581 gives its three bytes for a space: they stand for the space.
          for (size_t k = 0; k < ids.size(); ++k) {
            if (k + 2 < ids.size() && ids[k] == byte_id_[0xE2] && ids[k + 1] == byte_id_[0x96] &&
                ids[k + 2] == byte_id_[0x81]) {
              out.push_back(byte_id_[' ']);
              k += 2;
            } else {
              out.push_back(ids[k]);
            }
          }
        },
        [&](unsigned char b) { out.push_back(byte_id_[b]); });
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string out;
    for (const auto id : ids) {
      if (id < 0 || static_cast<size_t>(id) >= text_.size())
        throw std::out_of_range(
            fmt::format("tokenizer {}: id {} is outside its vocabulary of {}", spec_, id, text_.size()));
      out += text_[static_cast<size_t>(id)];
    }
    return out;
  }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  std::vector<std::string> text_;  // what each id decodes to ("" for control pieces)
  std::array<int32_t, 256> byte_id_{};
};

// Documents of the inputs, one per file; binary files (a NUL in the first 8 KiB) are skipped.
struct Documents {
  std::vector<std::string> texts;
  int64_t skipped = 0;
};

Documents read_documents(const std::vector<std::string>& inputs) {
  Documents d;
  for (const auto& root : inputs)
    for (const auto& p : list_text_files(root)) {
      auto text = read_text_file(p);
      if (text.empty()) continue;
      if (looks_binary(text)) {
        ++d.skipped;
        continue;
      }
      d.texts.push_back(std::move(text));
    }
  return d;
}

// Feeds SentencePiece's trainer the pieces-visible runs of the training documents.
class RunIterator : public sentencepiece::SentenceIterator {
 public:
  RunIterator(const std::vector<const std::string*>& docs, int64_t max_bytes) {
    for (const auto* d : docs) {
      split_for_pieces(
          *d,
          [&](std::string_view run) {
            if (bytes_ + static_cast<int64_t>(run.size()) <= max_bytes) {
              runs_.push_back(run);
              bytes_ += static_cast<int64_t>(run.size());
            }
          },
          [](unsigned char) {});
    }
    if (!runs_.empty()) value_ = std::string(runs_[0]);
  }
  bool done() const override { return i_ >= runs_.size(); }
  void Next() override {
    if (++i_ < runs_.size()) value_ = std::string(runs_[i_]);
  }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return {}; }
  int64_t bytes() const { return bytes_; }

 private:
  std::vector<std::string_view> runs_;
  size_t i_ = 0;
  std::string value_;
  int64_t bytes_ = 0;
};

}  // namespace

namespace {

TokenizerReport train_pieces(const TokenizerTrainOptions& o,
                             const std::function<void(const std::string&)>& progress) {
  const auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  const auto t0 = std::chrono::steady_clock::now();
  if (o.type != "bpe" && o.type != "unigram")
    throw BadInput(fmt::format("tokenizer train: --type must be bpe or unigram, got \"{}\"", o.type));
  if (o.vocab_size < 260)
    throw BadInput(
        fmt::format("tokenizer train: --vocab {} is too small: the 256 byte pieces and the "
                    "unknown and end-of-text pieces need 258, and pieces need the rest",
                    o.vocab_size));
  if (o.output.empty()) throw std::runtime_error("tokenizer train: no output file (-o tok.model)");
  say(fmt::format("reading {}", fmt::join(o.inputs, " ")));
  const Documents docs = read_documents(o.inputs);
  if (docs.texts.size() < 2)
    throw std::runtime_error(
        fmt::format("tokenizer train: {} gave {} text documents{}; need at least 2 (one held out)",
                    fmt::join(o.inputs, " "), docs.texts.size(),
                    docs.skipped ? fmt::format(" ({} binary files skipped)", docs.skipped) : ""));
  // Documents are held out by a seeded draw, at least one.
  std::vector<const std::string*> train, held;
  uint64_t s = o.seed ^ 0x70C3ull;
  for (const auto& d : docs.texts) (uniform01(s) < o.held_out ? held : train).push_back(&d);
  if (held.empty()) held.push_back(train.back()), train.pop_back();
  if (train.empty()) train.push_back(held.back()), held.pop_back();

  RunIterator it(train, o.max_training_bytes);
  TokenizerReport r;
  r.documents = static_cast<int64_t>(docs.texts.size());
  r.training_bytes = it.bytes();
  say(fmt::format("training a {} tokenizer of {} pieces on {:.1f} MB ({} documents{}, {} held out)", o.type,
                  o.vocab_size, it.bytes() / 1e6, train.size(),
                  docs.skipped ? fmt::format(", {} binary files skipped", docs.skipped) : "", held.size()));
  const int threads =
      o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", o.type},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"character_coverage", "0.9995"},
      {"max_sentence_length", "65536"},
      {"unk_id", "0"},
      {"eos_id", "1"},
      {"bos_id", "-1"},
      {"pad_id", "-1"},
      {"eos_piece", "<|endoftext|>"},
      {"num_threads", std::to_string(threads)},
      {"minloglevel", "2"},
  };
  std::string model;
  if (const auto st = sentencepiece::SentencePieceTrainer::Train(args, &it, &model); !st.ok())
    throw BadInput(fmt::format("tokenizer train: {}", user_text(st)));  // the text or the options
  const fs::path out(o.output);
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  write_file_atomically(o.output, model);

  say(fmt::format("measuring bytes per token on {} held-out documents", held.size()));
  const auto tok = Tokenizer::load(o.output);
  r.vocab_size = tok->vocab_size();
  for (const auto* d : held) {
    const auto ids = tok->encode(*d);
    if (tok->decode(ids) != *d)
      throw std::runtime_error(
          fmt::format("tokenizer train: {} does not round-trip a held-out document", o.output));
    r.held_out_bytes += static_cast<int64_t>(d->size());
    r.held_out_tokens += static_cast<int64_t>(ids.size());
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace

}  // namespace fsdpp::train

extern "C" __attribute__((visibility("default"))) const fsdpp::train::detail::SentencePiecePlugin*
fsdpp_sentencepiece_plugin() {
  static const fsdpp::train::detail::SentencePiecePlugin plugin{
      [](const std::string& path) -> std::shared_ptr<const fsdpp::train::Tokenizer> {
        return std::make_shared<fsdpp::train::PieceTokenizer>(path);
      },
      &fsdpp::train::train_pieces};
  return &plugin;
}
