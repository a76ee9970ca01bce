#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, the CUDA toolkit and PyTorch (whose wheel brings
# NCCL), but possibly no Debian packages: header-only dependencies come from a folder.
#   scripts/gpu-check.sh DEPS_DIR [OUT_DIR]
# DEPS_DIR holds doctest/doctest.h (and, for later parts, nlohmann/, fmt/, CLI/, Eigen/).
# What it runs so far: the NCCL backend's core test (collectives on one rank, on GPU 0). The
# remaining parts of the check (fully_shard CPU-vs-GPU equivalence, captured-graph vs eager, H200
# timings) need the LibTorch glue of the NCCL backend, which is not written yet.
set -euo pipefail
cd "$(dirname "$0")/.."
deps=$(cd "${1:?usage: scripts/gpu-check.sh DEPS_DIR [OUT_DIR]}" && pwd)
out=${2:-build-gpu}
mkdir -p "$out"

cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
[[ -f $cuda/include/cuda_runtime.h ]] || { echo "gpu-check: no CUDA toolkit at $cuda (set CUDA_HOME)" >&2; exit 1; }
nccl_inc=$cuda/include nccl_lib=$cuda/lib64
if [[ ! -f $nccl_inc/nccl.h ]]; then
  # PyTorch's wheels bring NCCL as the nvidia-nccl package.
  nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)
  [[ -n $nccl_root ]] || { echo "gpu-check: nccl.h is neither in $cuda/include nor in an nvidia-nccl wheel" >&2; exit 1; }
  nccl_inc=$nccl_root/include nccl_lib=$nccl_root/lib
fi
nccl_so=$(ls "$nccl_lib"/libnccl.so* | head -n 1)
echo "gpu-check: CUDA $cuda, NCCL $nccl_so"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

g++ -std=c++20 -O2 -Wall -Wextra -I"$deps" -I"$cuda/include" -I"$nccl_inc" \
  tests/main.cpp tests/dist/test_nccl_core.cpp src/dist/nccl/nccl_core.cpp \
  -L"$cuda/lib64" -lcudart "$nccl_so" -Wl,-rpath,"$cuda/lib64:$nccl_lib" -o "$out/test_nccl_core"
"$out/test_nccl_core"
if ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu-check: no GPU visible (nvidia-smi): only the no-GPU error path ran" >&2
  exit 1
fi
echo "gpu-check: NCCL core passed on the GPU; fully_shard, graph and timing checks are not part of this script yet"
