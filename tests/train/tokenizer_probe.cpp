// What tests/train/test_tokenizer_json.py compares with Hugging Face tokenizers: reads documents
// (each a little-endian uint32 byte count and the bytes, any bytes), encodes them with the tokenizer
// named, decodes the ids again, and writes per document: uint32 id count, the int32 ids, uint32 byte
// count, the decoded bytes. With --threads N the documents go through encode_all on N threads.
//   tokenizer_probe TOKENIZER DOCUMENTS OUTPUT [--threads N] [--repeat R]
// Prints {"vocab_size", "eot", "seconds", "bytes"}: seconds of the last of R encodings.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fsdpp/train/tokenizer.hpp"

int main(int argc, char** argv) try {
  if (argc < 4) {
    std::cerr << "usage: tokenizer_probe TOKENIZER DOCUMENTS OUTPUT [--threads N] [--repeat R]\n";
    return 2;
  }
  int threads = 0, repeat = 1;
  for (int i = 4; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--threads") == 0) threads = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--repeat") == 0) repeat = std::stoi(argv[i + 1]);
  }
  const auto tokenizer = fsdpp::train::Tokenizer::load(argv[1]);
  std::ifstream in(argv[2], std::ios::binary);
  std::vector<std::string> docs;
  uint64_t bytes = 0;
  for (uint32_t n; in.read(reinterpret_cast<char*>(&n), 4);) {
    std::string d(n, '\0');
    in.read(d.data(), n);
    bytes += n;
    docs.push_back(std::move(d));
  }
  std::vector<std::vector<int32_t>> ids;
  double seconds = 0;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (threads > 0) {
      ids = fsdpp::train::encode_all(*tokenizer, docs, threads);
    } else {
      ids.clear();
      for (const auto& d : docs) ids.push_back(tokenizer->encode(d));
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::ofstream out(argv[3], std::ios::binary);
  for (const auto& v : ids) {
    const uint32_t n = static_cast<uint32_t>(v.size());
    out.write(reinterpret_cast<const char*>(&n), 4);
    out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(4 * v.size()));
    const std::string text = tokenizer->decode(v);
    const uint32_t m = static_cast<uint32_t>(text.size());
    out.write(reinterpret_cast<const char*>(&m), 4);
    out.write(text.data(), m);
  }
  std::cout << nlohmann::json{{"vocab_size", tokenizer->vocab_size()},
                              {"eot", tokenizer->eot()},
                              {"seconds", seconds},
                              {"bytes", bytes}}
                   .dump()
            << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "tokenizer_probe: " << e.what() << "\n";
  return 2;
}
