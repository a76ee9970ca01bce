#!/usr/bin/env bash
# Builds fsdpp's GPU targets against another PyTorch release's LibTorch (default 2.11.0, the oldest
# we support and the one on the lent GPU machines), so that an API it lacks shows here, not on the
# device. Run after scripts/setup.sh (Debian's packages); the release goes into a virtual
# environment of its own beside the main one, $FSDPP_VENV-torch<VERSION> (about 3 GB once).
#   scripts/torch-compat.sh [VERSION] [BUILD_DIR]       (default 2.11.0, build-torch<VERSION>)
# It compiles and links; nothing runs (the GPU check, scripts/gpu-check.sh, runs on a device).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.11.0}
build=${2:-build-torch$version}
venv=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}-torch$version
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "torch-compat: installing torch==$version into $venv"
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "torch==$version"
fi
prefix=$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
echo "torch-compat: LibTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) at $prefix"
if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DFSDPP_PYTHON="$venv/bin/python" \
    -DFSDPP_WITH_NCCL=ON -DFSDPP_WITH_GLOO=OFF -DFSDPP_BUILD_BENCH=OFF
fi
cmake --build "$build" -j "${FSDPP_JOBS:-$(nproc)}" --target fsdpp fsdpp_cli fsdpp_header_check fsdpp_test_gpu \
  fsdpp_test_gpu_ranks fsdpp_test_nccl_core
echo "torch-compat: the GPU targets build against LibTorch $version"
