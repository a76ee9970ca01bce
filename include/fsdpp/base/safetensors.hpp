#pragma once
// The safetensors file format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON ({"name": {"dtype": "F32", "shape": [...], "data_offsets":
// [begin, end]}, ..., "__metadata__": {string: string}}), then the tensors' bytes, row-major,
// little-endian, offsets relative to the end of the header. Files written here are read by
// PyTorch's and Hugging Face's safetensors loaders, and files they write are read here.

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp {

struct SafetensorsFile {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // in file order
  std::map<std::string, std::string> metadata;
  const at::Tensor* find(const std::string& name) const;
};

// Writes `path` directly (callers that need atomicity write a temporary name and rename). CPU
// tensors of any dtype safetensors names (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL); names must be
// unique and must not be "__metadata__".
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The same, one tensor at a time: the header from `specs`, then produce(i) for each in order, each
// written before the next is asked for, so that only one is held at once. produce(i) must give
// specs[i]'s dtype and shape (std::logic_error otherwise, and nothing is left under `path`).
struct TensorSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
void write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                       const std::function<at::Tensor(size_t)>& produce,
                       const std::map<std::string, std::string>& metadata = {});

// Reads a whole file. Every inconsistency (truncated file, header past the end, bad JSON, unknown
// dtype, offsets out of range, overlapping or mis-sized tensors) throws std::runtime_error naming
// the file and, where there is one, the tensor. `mapped`: the tensors view a private mapping of
// the file instead (copy-on-write; read from the disk as they are touched, pages the kernel may
// drop again), so that converting a file larger than memory needs memory for the result only.
SafetensorsFile read_safetensors(const std::string& path, bool mapped = false);

}  // namespace fsdpp
