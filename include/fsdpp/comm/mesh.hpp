#pragma once
// DeviceMesh: the world laid out as a grid with named dimensions, for example {{"pp", 2}, {"dp", 2}}
// (row-major: the last dimension varies fastest across consecutive ranks). Each dimension has its
// own communicator, made by splitting the world once, eagerly, at construction.

#include <string>
#include <utility>
#include <vector>

#include "fsdpp/comm/comm.hpp"

namespace fsdpp::comm {

class DeviceMesh {
 public:
  using Dims = std::vector<std::pair<std::string, int>>;

  // Collective over `world`. Throws CommError when the product of the sizes differs from the world
  // size, a size is not positive, or a name repeats.
  DeviceMesh(Comm world, Dims dims);

  const Dims& dims() const { return dims_; }
  int size(const std::string& dim) const { return dims_[index(dim)].second; }
  // This rank's coordinate along `dim`.
  int coord(const std::string& dim) const { return coords_[index(dim)]; }
  const std::vector<int>& coords() const { return coords_; }
  // The communicator of the ranks that differ from this one only along `dim`.
  Comm& comm(const std::string& dim) { return comms_[index(dim)]; }
  Comm& world() { return world_; }
  // The world rank at the given coordinates.
  int rank_at(const std::vector<int>& coords) const;

 private:
  size_t index(const std::string& dim) const;

  Comm world_;
  Dims dims_;
  std::vector<int> coords_;
  std::vector<Comm> comms_;
};

}  // namespace fsdpp::comm
