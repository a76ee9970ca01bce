// Tokenizers and token shards: exact round trips on the fortunes corpus and on hostile bytes,
// tokenizer training, shards written by numpy in llm.c's and nanoGPT's layouts read back token for
// token, damaged shards named by file and offset, and `tokenize_to_shards` checked against the
// tokenizer it used.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fsdpp/train/data.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"

using namespace fsdpp;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kBundled = std::string(FSDPP_SOURCE_DIR) + "/recipes/tokenizers/fortunes-bpe-2048.model";
const std::string kPython = FSDPP_PYTHON;

fs::path fresh_dir(const std::string& name) {
  const auto d = fs::temp_directory_path() / ("fsdpp-tokens-" + std::to_string(getpid()) + "-" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// doctest's matcher copies the text it is given.
doctest::Contains has(const std::string& s) { return doctest::Contains(s.c_str()); }

void write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

std::string read(const fs::path& p) { return train::read_text_file(p.string()); }

// Every token of a source, segment after segment.
std::vector<int64_t> all_tokens(const train::TokenSource& s) {
  std::vector<int64_t> out;
  for (int64_t g = 0; g < s.segments(); ++g) {
    const auto n = s.segment_tokens(g);
    const auto at = out.size();
    out.resize(at + static_cast<size_t>(n));
    s.read(g, 0, n, out.data() + at);
  }
  return out;
}

void python(const std::string& code) {
  const auto script = fs::temp_directory_path() / ("fsdpp-tokens-" + std::to_string(getpid()) + ".py");
  write(script, code);
  const int rc = std::system((kPython + " " + script.string()).c_str());
  fs::remove(script);
  REQUIRE(rc == 0);
}

std::vector<std::string> fortune_files() {
  std::vector<std::string> out;
  for (const auto& p : train::list_text_files(train::fortunes_dir()))
    if (!fs::path(p).has_extension()) out.push_back(p);
  return out;
}

}  // namespace

TEST_CASE("tokenizer: the bundled BPE round-trips every fortune file exactly, in fewer tokens than bytes") {
  const auto tok = train::Tokenizer::load(kBundled);
  CHECK(tok->vocab_size() == 2048);
  CHECK(tok->hash().rfind("crc32c:", 0) == 0);
  int64_t bytes = 0, tokens = 0;
  const auto files = fortune_files();
  REQUIRE(files.size() > 10);
  for (const auto& f : files) {
    CAPTURE(f);
    const auto text = read(f);
    const auto ids = tok->encode(text);
    REQUIRE(std::all_of(ids.begin(), ids.end(), [](int32_t id) { return id >= 0 && id < 2048; }));
    REQUIRE(tok->decode(ids) == text);
    bytes += static_cast<int64_t>(text.size());
    tokens += static_cast<int64_t>(ids.size());
  }
  MESSAGE(fmt::format("fortunes: {} bytes in {} tokens, {:.3f} bytes/token", bytes, tokens,
                      double(bytes) / double(tokens)));
  CHECK(double(bytes) / double(tokens) > 2.0);
}

TEST_CASE(
    "tokenizer: bytes that SentencePiece cannot see still round-trip (invalid UTF-8, NUL, U+2581, CR, "
    "tabs)") {
  const auto tok = train::Tokenizer::load(kBundled);
  const std::vector<std::string> hostile = {
      "",
      " leading and trailing spaces  ",
      std::string("nul\0inside", 10),
      "\xff\xfe latin-1 \xe9t\xe9 and a cut sequence \xe2\x82",
      "\xE2\x96\x81 is SentencePiece's own space mark\xE2\x96\x81\xE2\x96\x81",
      "crlf\r\nlines\r\n\ttabs\t\n\n\n",
      "\xf0\x9f\x98\x80 emoji and \xed\xa0\x80 a surrogate",
  };
  for (const auto& s : hostile) {
    CAPTURE(s);
    CHECK(tok->decode(tok->encode(s)) == s);
  }
  const auto bytes = train::Tokenizer::load("bytes");
  CHECK(bytes->vocab_size() == 256);
  CHECK(bytes->eot() == -1);
  for (const auto& s : hostile) CHECK(bytes->decode(bytes->encode(s)) == s);
  CHECK_THROWS_WITH_AS(bytes->decode(std::vector<int32_t>{300}), doctest::Contains("300"), std::out_of_range);
  CHECK_THROWS_WITH_AS(tok->decode(std::vector<int32_t>{5000}), doctest::Contains("5000"), std::out_of_range);
}

TEST_CASE("tokenizer: training BPE and unigram on text files, the report, and errors naming the input") {
  const auto dir = fresh_dir("train");
  const auto files = fortune_files();
  for (size_t i = 0; i < 4; ++i) fs::copy_file(files[i], dir / ("doc" + std::to_string(i)));
  write(dir / "binary.dat", std::string("\0\1\2", 3));
  for (const std::string type : {"bpe", "unigram"}) {
    CAPTURE(type);
    train::TokenizerTrainOptions o;
    o.inputs = {dir.string()};
    o.output = (dir / "out" / (type + ".model")).string();
    o.vocab_size = 400;
    o.type = type;
    o.held_out = 0.25;
    std::vector<std::string> said;
    const auto r = train::train_tokenizer(o, [&](const std::string& s) { said.push_back(s); });
    CHECK(said.size() == 3);
    CHECK(r.vocab_size == 400);
    CHECK(r.documents == 4);  // the binary file is skipped
    CHECK(r.held_out_bytes > 0);
    CHECK(r.bytes_per_token() > 1.2);
    const auto tok = train::Tokenizer::load(o.output);
    CHECK(tok->vocab_size() == 400);
    CHECK(tok->eot() == 1);
    const auto text = read(files[5]);
    CHECK(tok->decode(tok->encode(text)) == text);
    // A tokenizer trained elsewhere is another tokenizer.
    const auto bundled = train::Tokenizer::load(kBundled);
    CHECK_THROWS_WITH_AS(tok->check_matches(bundled->identity(), "the run"),
                         has("the run was written with tokenizer " + bundled->spec()), std::runtime_error);
    CHECK_NOTHROW(tok->check_matches(tok->identity(), "the run"));
  }
  train::TokenizerTrainOptions bad;
  bad.inputs = {(dir / "missing").string()};
  bad.output = (dir / "x.model").string();
  CHECK_THROWS_WITH_AS(train::train_tokenizer(bad), has((dir / "missing").string()), std::runtime_error);
  bad.inputs = {dir.string()};
  bad.vocab_size = 100;
  CHECK_THROWS_WITH_AS(train::train_tokenizer(bad), doctest::Contains("--vocab 100 is too small"),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(train::Tokenizer::load((dir / "doc0").string()),
                       doctest::Contains("not a SentencePiece model"), std::runtime_error);
  CHECK_THROWS_WITH_AS(train::Tokenizer::load((dir / "nope.model").string()),
                       doctest::Contains("no such file"), std::runtime_error);
  fs::remove_all(dir);
}

TEST_CASE("tokenizer: a model that would change text is refused; one without a space piece keeps spaces") {
  const auto dir = fresh_dir("changes");
  const auto files = fortune_files();
  for (size_t i = 0; i < 4; ++i) fs::copy_file(files[i], dir / ("doc" + std::to_string(i)));
  train::TokenizerTrainOptions o;
  o.inputs = {dir.string()};
  o.output = (dir / "out" / "tok.model").string();
  o.vocab_size = 400;
  train::train_tokenizer(o);
  const std::string model = read(o.output);
  const auto variant = [&](const std::string& name, const std::string& from, const std::string& to) {
    const auto at = model.find(from);
    REQUIRE(at != std::string::npos);
    std::string m = model;
    m.replace(at, from.size(), to);
    write(dir / name, m);
    return (dir / name).string();
  };
  // The normalizer spec fsdpp writes: name "identity", no character map, add_dummy_prefix false,
  // remove_extra_whitespaces false. With a dummy prefix every encoded run would gain a space.
  const std::string spec = std::string("identity\x12\x00\x18\x00", 12);
  const auto prefixed = variant("prefixed.model", spec, std::string("identity\x12\x00\x18\x01", 12));
  CHECK_THROWS_WITH_AS(train::Tokenizer::load(prefixed), has("prefixed.model: does not give back the text"),
                       std::runtime_error);
  // The piece for U+2581 renamed U+2582: SentencePiece then falls back to the bytes of U+2581 for
  // each space, which stand for the space.
  const auto no_space = variant("no_space.model", "\x0a\x03\xE2\x96\x81", "\x0a\x03\xE2\x96\x82");
  const auto tok = train::Tokenizer::load(no_space);
  for (const std::string& text :
       std::vector<std::string>{"The quick brown fox", "  two  spaces ", read(files[5])})
    CHECK(tok->decode(tok->encode(text)) == text);
  fs::remove_all(dir);
}

TEST_CASE(
    "shards: files numpy writes in llm.c's layout (uint16 and uint32) and nanoGPT's read back token for "
    "token") {
  const auto dir = fresh_dir("numpy");
  for (const auto& sub : {"llmc16", "llmc32", "nanogpt"}) fs::create_directories(dir / sub);
  // llm.c's write_datafile, as its dev/data scripts call it: a 256 x int32 header (magic, version,
  // token count), then the tokens; two train shards and a val shard per directory.
  python(R"(
import numpy as np, sys
root = ")" +
         dir.string() + R"("
rng = np.random.default_rng(7)
def write_datafile(path, toks, magic, version, dtype):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(toks, dtype=dtype).tobytes())
for sub, magic, version, dtype, high in [("llmc16", 20240520, 1, np.uint16, 50257), ("llmc32", 20240801, 7, np.uint32, 128256)]:
    for name, n in [("data_val_000000.bin", 300), ("data_train_000001.bin", 1000), ("data_train_000002.bin", 777)]:
        toks = rng.integers(0, high, n)
        write_datafile(f"{root}/{sub}/{name}", toks, magic, version, dtype)
        np.savetxt(f"{root}/{sub}/{name}.txt", toks, fmt="%d")
# nanoGPT's prepare.py: bare uint16 arrays in train.bin and val.bin.
for name, n in [("train", 900), ("val", 100)]:
    toks = rng.integers(0, 50257, n)
    np.array(toks, dtype=np.uint16).tofile(f"{root}/nanogpt/{name}.bin")
    np.savetxt(f"{root}/nanogpt/{name}.bin.txt", toks, fmt="%d")
)");
  const auto expected = [&](const std::vector<fs::path>& txts) {
    std::vector<int64_t> out;
    for (const auto& t : txts) {
      std::ifstream f(t);
      for (int64_t v; f >> v;) out.push_back(v);
    }
    return out;
  };
  for (const auto& [sub, vocab] :
       std::vector<std::pair<std::string, int64_t>>{{"llmc16", 50257}, {"llmc32", 128256}}) {
    CAPTURE(sub);
    const train::ShardSet train((dir / sub).string(), "train", vocab),
        val((dir / sub).string(), "val", vocab);
    CHECK(train.segments() == 2);
    CHECK(train.tokens() == 1777);
    CHECK(all_tokens(train) ==
          expected({dir / sub / "data_train_000001.bin.txt", dir / sub / "data_train_000002.bin.txt"}));
    CHECK(all_tokens(val) == expected({dir / sub / "data_val_000000.bin.txt"}));
    CHECK(train.index().is_null());
  }
  const train::ShardSet nano((dir / "nanogpt").string(), "train", 50257);
  CHECK(all_tokens(nano) == expected({dir / "nanogpt" / "train.bin.txt"}));
  CHECK(nano.description().find("nanoGPT") != std::string::npos);
  // Samples over shards are the shards' windows.
  auto shared = std::make_shared<train::ShardSet>((dir / "llmc16").string(), "train", 50257);
  train::TokenStream stream(shared, 64, 3);
  CHECK(stream.windows() == (1000 - 1) / 64 + (777 - 1) / 64);
  const auto x = stream.samples(0, stream.windows());
  const auto first = expected({dir / "llmc16" / "data_train_000001.bin.txt"}),
             second = expected({dir / "llmc16" / "data_train_000002.bin.txt"});
  const int64_t in_first = (1000 - 1) / 64;
  for (int64_t i = 0; i < stream.windows(); ++i) {
    const int64_t w = stream.window_of(i);
    const auto& src = w < in_first ? first : second;
    const int64_t offset = (w < in_first ? w : w - in_first) * 64;
    const auto want =
        at::tensor(std::vector<int64_t>(src.begin() + offset, src.begin() + offset + 65), at::kLong);
    CHECK(x[i].equal(want));
  }
  fs::remove_all(dir);
}

TEST_CASE("shards: a cut-short, mislabelled or out-of-vocabulary shard is named with its offset") {
  const auto dir = fresh_dir("damaged");
  const auto make = [&](int32_t magic, int32_t version, int32_t count, std::vector<uint16_t> tokens) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::vector<int32_t> header(256, 0);
    header[0] = magic, header[1] = version, header[2] = count;
    std::ofstream f(dir / "x_train_000001.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    f.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(2 * tokens.size()));
    return (dir / "x_train_000001.bin").string();
  };
  const auto open = [&] { return train::ShardSet(dir.string(), "train", 1000); };
  const auto open_files = [] {
    return std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator{});
  };
  const auto fds = open_files();
  auto file = make(20240520, 1, 10, std::vector<uint16_t>(7, 5));
  CHECK_THROWS_WITH_AS(open(),
                       has(file + ": the header (offset 8) says 10 tokens, 1044 bytes in all, but the "
                                  "file has 1038 bytes (cut short at offset 1038)"),
                       std::runtime_error);
  file = make(20240521, 1, 3, std::vector<uint16_t>(3, 5));
  CHECK_THROWS_WITH_AS(open(), has(file + ": magic 20240521 at offset 0 is not llm.c's"), std::runtime_error);
  file = make(20240520, 7, 3, std::vector<uint16_t>(3, 5));
  CHECK_THROWS_WITH_AS(open(), has(file + ": version 7 at offset 4"), std::runtime_error);
  fs::remove_all(dir);
  fs::create_directories(dir);
  write(dir / "x_train_000001.bin", std::string(100, 'x'));
  CHECK_THROWS_WITH_AS(open(), doctest::Contains("100 bytes, shorter than llm.c's 1024-byte header"),
                       std::runtime_error);
  file = make(20240520, 1, 4, {1, 2, 1234, 3});
  const auto set = open();
  int64_t out[4];
  CHECK_THROWS_WITH_AS(
      set.read(0, 0, 4, out),
      has(file + ": token 1234 at byte offset 1028 is outside the model's vocabulary of 1000"),
      std::runtime_error);
  CHECK_THROWS_WITH_AS(train::ShardSet(dir.string(), "val", 1000), doctest::Contains("holds no val shards"),
                       std::runtime_error);
  CHECK(open_files() == fds);  // no descriptor stays open, for refused shards or mapped ones
  fs::remove_all(dir);
}

TEST_CASE("shards: tokenize_to_shards writes what the tokenizer gives, eot-separated, split and indexed") {
  const auto dir = fresh_dir("tokenize");
  const auto files = fortune_files();
  for (size_t i = 0; i < 6; ++i) fs::copy_file(files[i], dir / ("doc" + std::to_string(i)));
  const auto tok = train::Tokenizer::load(kBundled);
  train::TokenizeOptions o;
  o.inputs = {dir.string()};
  o.output = (dir / "out").string();
  o.tokens_per_shard = 5000;
  o.val_fraction = 0.2;
  train::TokenizeProgress last;
  const auto r = train::tokenize_to_shards(*tok, o, [&](const train::TokenizeProgress& p) { last = p; });
  CHECK(last.bytes_done == last.bytes_total);
  CHECK(last.tokens == r.train.tokens + r.val.tokens);
  CHECK(r.train.documents + r.val.documents == 6);
  CHECK(r.val.documents >= 1);
  const json index = json::parse(std::ifstream(dir / "out" / "index.json"));
  CHECK(index["tokenizer"] == tok->identity());
  CHECK(index["eot"] == tok->eot());
  CHECK(index["splits"]["train"]["tokens"] == r.train.tokens);
  // Every shard but the last of a split holds exactly tokens_per_shard.
  const train::ShardSet train(o.output, "train", tok->vocab_size()), val(o.output, "val", tok->vocab_size());
  CHECK(train.segments() == (r.train.tokens + 4999) / 5000);
  for (int64_t s = 0; s + 1 < train.segments(); ++s) CHECK(train.segment_tokens(s) == 5000);
  CHECK(train.tokens() == r.train.tokens);
  // The shards, split at eot, are the documents: the training ones in order, the others in val.
  std::vector<std::string> docs;
  for (const auto* split : {&train, &val}) {
    std::vector<int32_t> run;
    for (const auto t : all_tokens(*split)) {
      if (t == tok->eot()) {
        if (!run.empty()) docs.push_back(tok->decode(run));
        run.clear();
      } else {
        run.push_back(static_cast<int32_t>(t));
      }
    }
    docs.push_back(tok->decode(run));
  }
  std::sort(docs.begin(), docs.end());
  std::vector<std::string> want;
  for (size_t i = 0; i < 6; ++i) want.push_back(read(files[i]));
  std::sort(want.begin(), want.end());
  CHECK(docs == want);
  // An index whose token count is not a count (a float, negative, past int64) is named as malformed.
  for (const json bad : {json(1.5), json(-3), json(6.7e71), json(uint64_t(1) << 63), json("12")}) {
    CAPTURE(bad.dump());
    json damaged = index;
    damaged["shards"][0]["tokens"] = bad;
    write(dir / "out" / "index.json", damaged.dump());
    CHECK_THROWS_WITH_AS(
        train::ShardSet(o.output, "train", tok->vocab_size()),
        has("index.json is malformed: shard " + damaged["shards"][0]["file"].get<std::string>() +
            ": tokens must be a count, got " + bad.dump()),
        std::runtime_error);
  }
  // A second run replaces the first; a directory holding anything else is refused.
  CHECK_NOTHROW(train::tokenize_to_shards(*tok, o));
  write(dir / "out" / "notes.txt", "mine");
  CHECK_THROWS_WITH_AS(train::tokenize_to_shards(*tok, o),
                       doctest::Contains("notes.txt, which is not a shard"), std::runtime_error);
  fs::remove_all(dir);
}

TEST_CASE("tokenizer: encoding on several threads, in pieces cut at newlines, gives encode()'s tokens") {
  const auto tok = train::Tokenizer::load(kBundled);
  std::vector<std::string> texts;
  for (const auto& f : fortune_files()) texts.push_back(read(f));
  texts.push_back(std::string(3 << 20, 'a') + "\n" +
                  std::string(100, 'b'));  // a piece boundary inside a long line
  texts.push_back("");
  const auto all = train::encode_all(*tok, texts, 3);
  REQUIRE(all.size() == texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    CAPTURE(i);
    CHECK(all[i] == tok->encode(texts[i]));
  }
}

TEST_CASE("shards: a writer that is not closed leaves no file under the shard's name") {
  const auto dir = fresh_dir("writer");
  const auto path = (dir / "t_train_000001.bin").string();
  {
    train::ShardWriter w(path, train::kShardU16);
    const std::vector<int32_t> t(100, 7);
    w.append(t.data(), t.size());
    CHECK(fs::exists(path + ".tmp"));
  }
  CHECK_FALSE(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));
  {
    train::ShardWriter w(path, train::kShardU32);
    const std::vector<int32_t> t = {70000, 1, 2};
    w.append(t.data(), t.size());
    w.close();
  }
  const train::ShardSet set(dir.string(), "train", 100000);
  CHECK(all_tokens(set) == std::vector<int64_t>{70000, 1, 2});
  fs::remove_all(dir);
}
