#include "fsdpp/base/safetensors.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"

namespace fsdpp {

namespace {

using nlohmann::json;

constexpr std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool}};

const char* dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : kDtypes)
    if (type == t) return name;
  throw std::invalid_argument(fmt::format("safetensors: dtype {} has no safetensors name", c10::toString(t)));
}

// Header JSON larger than this is refused before it is allocated (the format's own readers use
// 100 MB).
constexpr uint64_t kMaxHeader = 100u << 20;

}  // namespace

const at::Tensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

void write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                       const std::function<at::Tensor(size_t)>& produce,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& spec : specs) {
    if (spec.name == "__metadata__" || header.contains(spec.name))
      throw std::invalid_argument(
          fmt::format("write_safetensors {}: tensor name '{}' is reserved or repeated", path, spec.name));
    uint64_t numel = 1;
    for (const auto d : spec.shape) numel *= static_cast<uint64_t>(d);
    const uint64_t bytes = numel * at::elementSize(spec.dtype);
    header[spec.name] = {
        {"dtype", dtype_name(spec.dtype)}, {"shape", spec.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  // Through a temporary file: a failed or interrupted write leaves nothing under `path`.
  AtomicFile f(path);
  const uint64_t n = h.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  f.write(len, 8);
  f.write(h);
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto c = produce(i).detach().to(at::kCPU).contiguous();
    if (c.scalar_type() != specs[i].dtype || c.sizes() != at::IntArrayRef(specs[i].shape))
      throw std::logic_error(
          fmt::format("write_safetensors {}: '{}' was announced as {} [{}], produced as {} [{}]", path,
                      specs[i].name, c10::toString(specs[i].dtype), fmt::join(specs[i].shape, ", "),
                      c10::toString(c.scalar_type()), fmt::join(c.sizes(), ", ")));
    f.write(c.data_ptr(), static_cast<size_t>(c.numel() * c.element_size()));
  }
  f.commit();
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  write_safetensors(
      path, specs, [&](size_t i) { return tensors[i].second; }, metadata);
}

SafetensorsFile read_safetensors(const std::string& path, bool mapped) {
  require_regular_file(path, "safetensors file");
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error(fmt::format("read_safetensors: cannot open {}", path));
  const uint64_t size = static_cast<uint64_t>(f.tellg());
  f.seekg(0);
  auto fail = [&](const std::string& what) {
    return std::runtime_error(fmt::format("read_safetensors {}: {}", path, what));
  };
  if (size < 8) throw fail(fmt::format("{} bytes, too short for the 8-byte header length", size));
  unsigned char len[8];
  f.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  if (n > kMaxHeader || n > size - 8)
    throw fail(fmt::format("header length {} does not fit the file ({} bytes)", n, size));
  std::string h(n, '\0');
  f.read(h.data(), static_cast<std::streamsize>(n));
  json header;
  try {
    header = json::parse(h);
  } catch (const json::exception& e) {
    throw fail(fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!header.is_object()) throw fail("header is not a JSON object");
  const uint64_t data_size = size - 8 - n;

  SafetensorsFile out;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  std::vector<std::pair<std::string, std::pair<uint64_t, at::Tensor>>> pending;
  std::map<std::string, std::vector<int64_t>> shapes;  // mapped: each tensor's, made a view later
  for (const auto& item : header.items()) {
    const std::string name = item.key();
    const json& e = item.value();
    if (name == "__metadata__") {
      if (!e.is_object()) throw fail("__metadata__ is not an object");
      for (const auto& [k, v] : e.items()) {
        if (!v.is_string()) throw fail(fmt::format("__metadata__.{} is not a string", k));
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) { return fail(fmt::format("tensor '{}': {}", name, what)); };
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      throw bad("needs dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) throw bad("dtype is not a string");
    const auto dname = e["dtype"].get<std::string>();
    const auto* it =
        std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const auto& d) { return dname == d.first; });
    if (it == std::end(kDtypes)) throw bad(fmt::format("unsupported dtype '{}'", dname));
    if (!e["shape"].is_array()) throw bad("shape is not an array");
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) throw bad("shape holds a value that is not a non-negative integer");
      const uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t(1) << 40) || (v && numel > (uint64_t(1) << 40) / v)) throw bad("shape is too large");
      numel *= v;
      shape.push_back(static_cast<int64_t>(v));
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      throw bad("data_offsets is not a pair of non-negative integers");
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    const uint64_t bytes = numel * c10::elementSize(it->second);
    if (b > en || en > data_size)
      throw bad(fmt::format("data_offsets [{}, {}] outside the {} data bytes", b, en, data_size));
    if (en - b != bytes)
      throw bad(fmt::format("data_offsets span {} bytes, shape and dtype need {}", en - b, bytes));
    spans.push_back({b, en, name});
    pending.emplace_back(name, std::make_pair(b, at::empty(mapped ? std::vector<int64_t>{0} : shape,
                                                           at::TensorOptions().dtype(it->second))));
    if (mapped) shapes[name] = std::move(shape);
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].begin < spans[i - 1].end)
      throw fail(fmt::format("tensors '{}' and '{}' overlap", spans[i - 1].name, spans[i].name));
  // File order: by offset.
  std::sort(pending.begin(), pending.end(),
            [](const auto& a, const auto& b) { return a.second.first < b.second.first; });
  if (mapped) {
    // One private (copy-on-write) mapping of the whole file, unmapped with the last tensor that
    // views it; a tensor whose offset its element size does not divide is copied out instead.
    f.close();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw fail(fmt::format("cannot open: {}", os_error(errno)));
    void* base = size ? ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0) : nullptr;
    const int err = errno;
    ::close(fd);
    if (base == MAP_FAILED) throw fail(fmt::format("cannot map: {}", os_error(err)));
    auto mapping = std::shared_ptr<void>(base, [size](void* p) {
      if (p) ::munmap(p, size);
    });
    for (auto& [name, p] : pending) {
      auto& [b, t] = p;
      char* data = static_cast<char*>(base) + 8 + n + b;
      const auto options = at::TensorOptions().dtype(t.scalar_type());
      auto view = at::from_blob(
          data, shapes[name], [mapping](void*) {}, options);
      if (reinterpret_cast<uintptr_t>(data) % t.element_size() != 0) view = view.clone();
      out.tensors.emplace_back(name, std::move(view));
    }
    return out;
  }
  for (auto& [name, p] : pending) {
    auto& [b, t] = p;
    f.seekg(static_cast<std::streamoff>(8 + n + b));
    f.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
    if (!f) throw fail(fmt::format("tensor '{}': read failed", name));
    out.tensors.emplace_back(name, std::move(t));
  }
  return out;
}

}  // namespace fsdpp
