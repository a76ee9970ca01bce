// Data order: epochs visit every window once across data-parallel ranks, order is a function of
// the seed alone, windows stay inside their segment; fortunes split into documents, validation
// documents stay out of training.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "fsdpp/train/data.hpp"
#include "fsdpp/train/recipe.hpp"

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

std::vector<int32_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// Segments of the given lengths; token i of segment s is 1000 * s + i.
class Segments final : public train::TokenSource {
 public:
  explicit Segments(std::vector<int64_t> sizes) : sizes_(std::move(sizes)) {}
  int64_t segments() const override { return static_cast<int64_t>(sizes_.size()); }
  int64_t segment_tokens(int64_t s) const override { return sizes_[static_cast<size_t>(s)]; }
  void read(int64_t s, int64_t offset, int64_t count, int64_t* out) const override {
    REQUIRE(offset + count <= sizes_[static_cast<size_t>(s)]);
    for (int64_t i = 0; i < count; ++i) out[i] = 1000 * s + offset + i;
  }

 private:
  std::vector<int64_t> sizes_;
};

std::string text(int64_t n) {
  std::string s;
  for (int64_t i = 0; i < n; ++i) s.push_back(static_cast<char>('a' + (i * 7 + i / 13) % 26));
  return s;
}

}  // namespace

TEST_CASE("data: every window is seen once per epoch across the dp ranks, whatever the layout") {
  const int64_t seq = 8, windows = 60;
  for (int dp : {1, 2, 3, 4}) {
    for (int64_t batch : {12, 60}) {
      if (batch % dp) continue;
      CAPTURE(dp);
      CAPTURE(batch);
      train::TokenStream stream(bytes_of(text(windows * seq + 1)), seq, 42);
      REQUIRE(stream.windows() == windows);
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        std::multiset<int64_t> seen;
        std::vector<int64_t> order;
        for (int64_t step = epoch * windows / batch; step < (epoch + 1) * windows / batch; ++step)
          for (int r = 0; r < dp; ++r)
            for (int64_t i = 0; i < batch / dp; ++i) {
              const int64_t w = stream.window_of(step * batch + r * (batch / dp) + i);
              seen.insert(w);
              order.push_back(w);
            }
        CHECK(seen.size() == size_t(windows));
        CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == size_t(windows));
        std::vector<int64_t> sorted(order);
        std::sort(sorted.begin(), sorted.end());
        CHECK(order != sorted);  // shuffled
      }
    }
  }
}

TEST_CASE("data: samples are the window's bytes; same seed same order, another seed another") {
  const int64_t seq = 5;
  const auto s = text(5 * 40 + 1);
  train::TokenStream a(bytes_of(s), seq, 7), b(bytes_of(s), seq, 7), c(bytes_of(s), seq, 8);
  const auto x = a.samples(10, 6);
  CHECK(x.equal(b.samples(10, 6)));
  CHECK_FALSE(x.equal(c.samples(10, 6)));
  for (int64_t i = 0; i < 6; ++i) {
    const int64_t w = a.window_of(10 + i);
    for (int64_t t = 0; t <= seq; ++t)
      CHECK(x[i][t].item<int64_t>() == static_cast<unsigned char>(s[w * seq + t]));
  }
  // Epochs differ in order.
  std::vector<int64_t> e0, e1;
  for (int64_t g = 0; g < a.windows(); ++g)
    e0.push_back(a.window_of(g)), e1.push_back(a.window_of(g + a.windows()));
  CHECK(e0 != e1);
  CHECK_THROWS_WITH_AS(train::TokenStream(bytes_of("abc"), 8, 1), doctest::Contains("cannot make one sample"),
                       std::runtime_error);
}

TEST_CASE("data: the epoch order is a bijection of [0, n) for every n, and another key gives another") {
  for (int64_t n : {1, 2, 3, 5, 16, 17, 100, 1000, 4097}) {
    CAPTURE(n);
    std::vector<int64_t> a, b;
    for (int64_t i = 0; i < n; ++i)
      a.push_back(train::permute_index(i, n, 11)), b.push_back(train::permute_index(i, n, 12));
    std::vector<int64_t> sorted(a);
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) REQUIRE(sorted[static_cast<size_t>(i)] == i);
    if (n >= 5) CHECK(a != b);
  }
}

TEST_CASE("data: windows never straddle two segments (two shards), and every one is read") {
  const int64_t seq = 4;
  // 9 tokens: windows at 0 and 4 (the second needs tokens 4..8); 4 tokens: none; 14: 3.
  train::TokenStream stream(std::make_shared<Segments>(std::vector<int64_t>{9, 4, 14}), seq, 5);
  REQUIRE(stream.windows() == 5);
  const auto x = stream.samples(0, 5);
  std::set<int64_t> starts;
  for (int64_t i = 0; i < 5; ++i) {
    const int64_t first = x[i][0].item<int64_t>();
    starts.insert(first);
    for (int64_t t = 1; t <= seq; ++t) CHECK(x[i][t].item<int64_t>() == first + t);  // one segment, in order
  }
  CHECK(starts == std::set<int64_t>{0, 4, 2000, 2004, 2008});
}

TEST_CASE("data: fortunes split into documents; indexes and symlinks skipped; validation kept apart") {
  const fs::path dir = fs::temp_directory_path() / ("fsdpp-fortunes-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string all;
  for (int f = 0; f < 3; ++f) {
    std::ofstream out(dir / ("file" + std::to_string(f)));
    for (int d = 0; d < 10; ++d) out << "fortune " << f << "." << d << "\nsecond line\n%\n";
  }
  { std::ofstream(dir / "file0.dat") << std::string(64, '\0'); }
  fs::create_symlink(dir / "file0", dir / "file0.u8");
  setenv("FSDPP_FORTUNES_DIR", dir.c_str(), 1);
  train::DataOptions o;
  o.val_fraction = 0.1;
  const auto c = train::load_corpus(o, 3);
  unsetenv("FSDPP_FORTUNES_DIR");
  CHECK(c.documents == 30);
  CHECK(c.val_documents == 3);
  const std::string tr(c.train.begin(), c.train.end()), va(c.val.begin(), c.val.end());
  CHECK(tr.find('%') == std::string::npos);
  CHECK(tr.find('\0') == std::string::npos);
  int in_val = 0;
  for (int f = 0; f < 3; ++f)
    for (int d = 0; d < 10; ++d) {
      const auto doc = "fortune " + std::to_string(f) + "." + std::to_string(d) + "\n";
      const bool t = tr.find(doc) != std::string::npos, v = va.find(doc) != std::string::npos;
      CHECK(t != v);  // in exactly one split
      in_val += v;
    }
  CHECK(in_val == 3);
  // The same seed gives the same split.
  setenv("FSDPP_FORTUNES_DIR", dir.c_str(), 1);
  CHECK(train::load_corpus(o, 3).val == c.val);
  unsetenv("FSDPP_FORTUNES_DIR");
  fs::remove_all(dir);
}

TEST_CASE("data: missing inputs are named") {
  train::DataOptions o;
  o.source = train::DataSource::kFiles;
  o.paths = {"/nonexistent/fsdpp-corpus"};
  CHECK_THROWS_WITH_AS(train::load_corpus(o, 1), doctest::Contains("/nonexistent/fsdpp-corpus"),
                       std::runtime_error);
}
