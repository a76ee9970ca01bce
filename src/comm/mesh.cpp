#include "fsdpp/comm/mesh.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>

namespace fsdpp::comm {

DeviceMesh::DeviceMesh(Comm world, Dims dims) : world_(std::move(world)), dims_(std::move(dims)) {
  if (dims_.empty()) throw CommError("DeviceMesh: give at least one dimension");
  int64_t product = 1;
  std::set<std::string> names;
  for (const auto& [name, n] : dims_) {
    if (n < 1) throw CommError(fmt::format("DeviceMesh: dimension '{}' has size {}", name, n));
    if (!names.insert(name).second)
      throw CommError(fmt::format("DeviceMesh: dimension '{}' appears twice", name));
    product *= n;
  }
  if (product != world_.size()) {
    std::vector<std::string> parts;
    for (const auto& [name, n] : dims_) parts.push_back(fmt::format("{}={}", name, n));
    throw CommError(fmt::format("DeviceMesh: {} gives {} ranks, but the world has {}",
                                fmt::join(parts, " x "), product, world_.size()));
  }
  // Row-major coordinates of this rank.
  coords_.resize(dims_.size());
  for (int r = world_.rank(), d = static_cast<int>(dims_.size()) - 1; d >= 0; --d) {
    coords_[d] = r % dims_[d].second;
    r /= dims_[d].second;
  }
  // Ranks that share every coordinate but d's form d's group; color = index of the others.
  for (size_t d = 0; d < dims_.size(); ++d) {
    int color = 0;
    for (size_t e = 0; e < dims_.size(); ++e)
      if (e != d) color = color * dims_[e].second + coords_[e];
    comms_.push_back(world_.split(color, coords_[d]));
  }
}

size_t DeviceMesh::index(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].first == dim) return i;
  std::vector<std::string> names;
  for (const auto& d : dims_) names.push_back(d.first);
  throw CommError(fmt::format("DeviceMesh: no dimension '{}' (have {})", dim, fmt::join(names, ", ")));
}

int DeviceMesh::rank_at(const std::vector<int>& coords) const {
  if (coords.size() != dims_.size())
    throw CommError(
        fmt::format("DeviceMesh::rank_at: {} coordinates for {} dimensions", coords.size(), dims_.size()));
  int r = 0;
  for (size_t d = 0; d < dims_.size(); ++d) {
    if (coords[d] < 0 || coords[d] >= dims_[d].second)
      throw CommError(fmt::format("DeviceMesh::rank_at: coordinate {} of '{}' is outside [0, {})", coords[d],
                                  dims_[d].first, dims_[d].second));
    r = r * dims_[d].second + coords[d];
  }
  return r;
}

}  // namespace fsdpp::comm
