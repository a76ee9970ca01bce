#include "fsdpp/train/tokenizer.hpp"

#include <fmt/format.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>

#include "fsdpp/base/paths.hpp"
#include "piece_tokenizer.hpp"
#include "text/json_tokenizer.hpp"

namespace fsdpp::train {

namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  ByteTokenizer() { spec_ = hash_ = "bytes"; }
  int64_t vocab_size() const override { return 256; }
  int32_t eot() const override { return -1; }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out(text.size());
    for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
    return out;
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (const auto id : ids) {
      if (id < 0 || id > 255)
        throw std::out_of_range(fmt::format("tokenizer bytes: id {} is not a byte", id));
      out.push_back(static_cast<char>(id));
    }
    return out;
  }
};

// tokenizers writes a tokenizer.json with '{' first; a SentencePiece model (protobuf) starts with 0x0A.
bool looks_like_json(const std::string& path) {
  if (path.ends_with(".json")) return true;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  const int c = std::fgetc(f);
  std::fclose(f);
  return c == '{';
}

}  // namespace

std::shared_ptr<const Tokenizer> Tokenizer::load(const std::string& spec) {
  if (spec == "bytes") return std::make_shared<ByteTokenizer>();
  constexpr const char* kKinds =
      "a tokenizer.json, a transformers directory, a SentencePiece .model, or \"bytes\"";
  // Named here, as bad input, before either reader opens it.
  std::error_code ec;
  const auto type = std::filesystem::status(spec, ec).type();
  if (type == std::filesystem::file_type::directory) return text::load_json_tokenizer(spec);
  if (type != std::filesystem::file_type::regular) {
    const auto kind = kind_of(type);
    const auto path = std::filesystem::absolute(spec).lexically_normal().string();  // as recorded
    throw BadInput(kind == "missing"
                       ? fmt::format("tokenizer {}: no such file ({})", path, kKinds)
                       : fmt::format("tokenizer {} is {}, not a regular file ({})", path, kind, kKinds));
  }
  if (looks_like_json(spec)) return text::load_json_tokenizer(spec);
  return detail::load_piece_tokenizer(spec);
}

nlohmann::json Tokenizer::identity() const {
  return {{"spec", spec_}, {"hash", hash_}, {"vocab_size", vocab_size()}};
}

void Tokenizer::check_matches(const nlohmann::json& recorded, const std::string& where) const {
  const std::string hash = recorded.value("hash", std::string("bytes"));
  if (hash != hash_)
    throw std::runtime_error(fmt::format("{} was written with tokenizer {} ({}), not {} ({})", where,
                                         recorded.value("spec", std::string("?")), hash, spec_, hash_));
}

std::vector<std::vector<int32_t>> encode_all(const Tokenizer& tok, std::span<const std::string> texts,
                                             int threads) {
  struct Piece {
    size_t text;
    std::string_view view;
    std::vector<int32_t> ids;
  };
  // A tokenizer.json's pre-tokenizer may join a newline to the text around it (GPT-2's \s+(?!\S)).
  const size_t kPiece = tok.tokenizer_json().empty() ? size_t{1} << 20 : SIZE_MAX;
  std::vector<Piece> pieces;
  for (size_t t = 0; t < texts.size(); ++t) {
    const std::string_view s = texts[t];
    for (size_t begin = 0; begin < s.size();) {
      size_t end = s.size() - begin <= kPiece ? s.size() : s.find('\n', begin + kPiece);
      end = end == std::string_view::npos ? s.size() : end + 1;
      pieces.push_back({t, s.substr(begin, end - begin), {}});
      begin = end;
    }
  }
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads =
      static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), std::max<size_t>(1, pieces.size())));
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto work = [&] {
    for (size_t i; (i = next++) < pieces.size();) try {
        pieces[i].ids = tok.encode(pieces[i].view);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
      }
  };
  std::vector<std::thread> pool;
  for (int k = 1; k < threads; ++k) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
  std::vector<std::vector<int32_t>> out(texts.size());
  for (auto& p : pieces) out[p.text].insert(out[p.text].end(), p.ids.begin(), p.ids.end());
  return out;
}

}  // namespace fsdpp::train
