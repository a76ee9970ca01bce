// For tests/train/test_hf.py: fsdpp's logits for given tokens, from any model path load_model
// reads (a run, a consolidated file, a transformers directory), and a tokenizer's ids for a text.
//   fsdpp_hf_probe MODEL IN.safetensors OUT.safetensors
//     IN holds "tokens" (int64 [B, T]) and optionally "positions" (int64 [B, T], packed samples);
//     OUT receives "logits" (float32 [B, T, vocab]).
//   fsdpp_hf_probe encode TOKENIZER TEXT_FILE
//     prints the ids of the file's text, one line of numbers separated by spaces.
//   fsdpp_hf_probe chat-batch RECIPE STEP OUT.safetensors
//     the global batch of STEP of a recipe with data.source "chat": "inputs" and "targets" (int64
//     [global_batch, seq_len], -100 where a target does not count), and "positions" when packed.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/train/chat_data.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "encode") {
    try {
      std::ifstream f(argv[3], std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(f)), {});
      for (const auto id : fsdpp::train::Tokenizer::load(argv[2])->encode(text)) std::cout << id << ' ';
      std::cout << '\n';
    } catch (const std::exception& e) {
      std::cerr << "fsdpp_hf_probe: " << e.what() << "\n";
      return 1;
    }
    return 0;
  }
  if (argc == 5 && std::string(argv[1]) == "chat-batch") {
    try {
      const auto recipe = fsdpp::train::load_recipe(argv[2]);
      const auto chat = fsdpp::train::load_chat(recipe.data, *recipe.tokenizer, uint64_t(recipe.train.seed));
      const int64_t B = recipe.train.global_batch;
      const auto b = chat.train->samples(std::stoll(argv[3]) * B, B);
      std::vector<std::pair<std::string, at::Tensor>> out{{"inputs", b.inputs}, {"targets", b.targets}};
      if (b.positions.defined()) out.emplace_back("positions", b.positions);
      fsdpp::write_safetensors(argv[4], out);
    } catch (const std::exception& e) {
      std::cerr << "fsdpp_hf_probe: " << e.what() << "\n";
      return 1;
    }
    return 0;
  }
  if (argc != 4) {
    std::cerr << "usage: fsdpp_hf_probe MODEL IN.safetensors OUT.safetensors\n";
    return 2;
  }
  try {
    at::NoGradGuard no_grad;
    auto model = fsdpp::train::load_model(argv[1]);
    model->eval();
    const auto in = fsdpp::read_safetensors(argv[2]);
    const auto* tokens = in.find("tokens");
    if (!tokens) throw std::runtime_error("no tensor 'tokens'");
    if (const auto* positions = in.find("positions")) model->set_positions(*positions);
    fsdpp::write_safetensors(argv[3], {{"logits", model->forward(*tokens).contiguous()}});
  } catch (const std::exception& e) {
    std::cerr << "fsdpp_hf_probe: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
