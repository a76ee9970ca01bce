// safetensors: round trips in every dtype, a file assembled byte by byte from the format's
// description, and a clear error for each kind of damage.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <vector>
#include <filesystem>
#include <fstream>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/safetensors.hpp"

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

std::string temp_file(const std::string& name) {
  return (fs::temp_directory_path() / ("fsdpp-st-" + std::to_string(getpid()) + "-" + name)).string();
}

void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << header << data;
}

std::string read_error(const std::string& path, bool mapped = false) {
  try {
    read_safetensors(path, mapped);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("safetensors: round trip in every dtype, with empty and scalar tensors and metadata") {
  std::vector<std::pair<std::string, at::Tensor>> ts;
  for (auto t : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort,
                 at::kChar, at::kByte, at::kBool})
    ts.emplace_back(std::string("t.") + c10::toString(t), (at::randn({3, 5}) * 50).to(t));
  ts.emplace_back("empty", at::empty({0, 4}));
  ts.emplace_back("scalar", at::full({}, 2.5));
  ts.emplace_back("strided", at::arange(24.).view({4, 6}).t());  // non-contiguous input
  const auto path = temp_file("round");
  write_safetensors(path, ts, {{"format", "pt"}, {"note", "x"}});
  for (const bool mapped : {false, true}) {
    CAPTURE(mapped);
    const auto f = read_safetensors(path, mapped);
    CHECK(f.metadata.at("note") == std::string("x"));
    REQUIRE(f.tensors.size() == ts.size());
    for (const auto& [name, t] : ts) {
      CAPTURE(name);
      const auto* got = f.find(name);
      REQUIRE(got);
      CHECK((got->scalar_type() == t.scalar_type()));
      CHECK(got->equal(t));
    }
  }
  fs::remove(path);
}

TEST_CASE("safetensors: mapped tensors outlive the file object, copy on write, and may sit unaligned") {
  // "b" U8 [3] first, so that "a" (F32) starts at data offset 3: not a multiple of 4.
  std::string data = "\x01\x02\x03";
  for (float v : {1.5f, -2.0f}) data.append(reinterpret_cast<const char*>(&v), 4);
  std::string header = R"({"b":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                       R"("a":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}})";
  while ((8 + header.size()) % 4 != 0) header += ' ';  // the data starts 4-aligned, "a" 3 bytes past
  const auto path = temp_file("mapped");
  write_raw(path, header, data);
  at::Tensor a, b;
  {
    const auto f = read_safetensors(path, /*mapped=*/true);
    a = *f.find("a");
    b = *f.find("b");
  }
  CHECK(a.equal(at::tensor({1.5f, -2.0f})));
  CHECK(b.equal(at::tensor({1, 2, 3}, at::kByte)));
  b.fill_(9);  // the mapping is private: the file keeps its bytes
  CHECK(read_safetensors(path).find("b")->equal(at::tensor({1, 2, 3}, at::kByte)));
  fs::remove(path);
}

TEST_CASE("safetensors: reads a file laid out by hand from the format description") {
  // Two tensors: "a" F32 [2] = {1.5, -2}, "b" I16 [3] = {1, 2, 3}, little-endian, data after the header.
  std::string data;
  for (float v : {1.5f, -2.0f}) data.append(reinterpret_cast<const char*>(&v), 4);
  for (int16_t v : {1, 2, 3}) data.append(reinterpret_cast<const char*>(&v), 2);
  const std::string header =
      R"({"b":{"dtype":"I16","shape":[3],"data_offsets":[8,14]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}})";
  const auto path = temp_file("hand");
  write_raw(path, header, data);
  const auto f = read_safetensors(path);
  CHECK(f.find("a")->equal(at::tensor({1.5f, -2.0f})));
  CHECK(f.find("b")->equal(at::tensor({1, 2, 3}, at::kShort)));
  CHECK(f.tensors.front().first == std::string("a"));  // file order
  CHECK(f.metadata.at("k") == std::string("v"));
  // And what we write has this layout: the length prefix, then JSON, then the bytes.
  write_safetensors(path, {{"a", at::tensor({1.5f, -2.0f})}});
  std::ifstream in(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), {});
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(all[i])) << (8 * i);
  CHECK(n % 8 == 0);
  CHECK(all.size() == 8 + n + 8);
  CHECK(all.substr(8, n).find(R"("a":{"data_offsets":[0,8],"dtype":"F32","shape":[2]})") !=
        std::string::npos);
  CHECK(std::memcmp(all.data() + 8 + n, data.data(), 8) == 0);
  fs::remove(path);
}

TEST_CASE("safetensors: damaged files give errors that say what is wrong") {
  const auto path = temp_file("bad");
  const std::string ok_a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    std::string header, data, expect;
  } cases[] = {
      {"{" + ok_a + "}", "1234", "outside the 4 data bytes"},
      {"{" + ok_a, "12345678", "not valid JSON"},
      {R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", "12345678", "unsupported dtype 'F99'"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "123456789012", "need 12"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", "12345678", "non-negative integer"},
      {R"({"a":{"dtype":"F32","shape":[2]}})", "12345678", "needs dtype, shape and data_offsets"},
      {"{" + ok_a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "12345678", "overlap"},
      {"[1,2]", "", "not a JSON object"},
      {R"({"__metadata__":{"k":1}})", "", "__metadata__.k is not a string"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.header);
    write_raw(path, c.header, c.data);
    for (const bool mapped : {false, true}) {
      const auto err = read_error(path, mapped);
      CHECK_MESSAGE(err.find(c.expect) != std::string::npos, err);
      CHECK(err.find(path) != std::string::npos);
    }
  }
  {
    std::ofstream f(path, std::ios::binary);
    f << "abc";
  }
  CHECK(read_error(path).find("too short") != std::string::npos);
  {
    std::ofstream f(path, std::ios::binary);
    f << std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8) << "{}";
  }
  CHECK(read_error(path).find("does not fit") != std::string::npos);
  fs::remove(path);
  CHECK(read_error(path).find("safetensors file " + path + " is missing") != std::string::npos);
  fs::create_directories(path);  // a directory, a FIFO: named, never opened (docs/cli.md, "Files")
  CHECK(read_error(path).find(path + " is a directory, not a regular file") != std::string::npos);
  fs::remove(path);
}

TEST_CASE("CRC-32C: the standard check value, any split, and the instruction path equal to the table") {
  const std::string check = "123456789";
  CHECK(crc32c(check.data(), check.size()) ==
        0xE3069283u);  // the check value of CRC-32C (RFC 3720's polynomial)
  CHECK(fsdpp::detail::crc32c_portable(check.data(), check.size()) == 0xE3069283u);
  CHECK(crc32c(nullptr, 0) == 0u);
  // Lengths and alignments the word loop and its tail both see; summed in two pieces too.
  std::vector<unsigned char> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>((i * 2654435761u) >> 13);
  for (size_t begin : {0, 1, 3, 7})
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 65, 993 - 7}) {
      CAPTURE(begin);
      CAPTURE(n);
      const uint32_t whole = crc32c(bytes.data() + begin, n);
      CHECK(whole == fsdpp::detail::crc32c_portable(bytes.data() + begin, n));
      const size_t half = n / 3;
      CHECK(crc32c(bytes.data() + begin + half, n - half, crc32c(bytes.data() + begin, half)) == whole);
    }
  // A file's digest is its bytes' CRC; one changed bit changes it.
  const auto path = temp_file("crc");
  std::ofstream(path, std::ios::binary) << std::string(bytes.begin(), bytes.end());
  const auto d = digest_file(path);
  CHECK(d.bytes == bytes.size());
  CHECK(d.crc32c == crc32c(bytes.data(), bytes.size()));
  bytes[500] ^= 0x10;
  std::ofstream(path, std::ios::binary) << std::string(bytes.begin(), bytes.end());
  CHECK(digest_file(path).crc32c != d.crc32c);
  CHECK(crc_hex(0xE3069283u) == "e3069283");
  fs::remove(path);
}
