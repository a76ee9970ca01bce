#!/usr/bin/env bash
# Collects what scripts/gpu-check.sh needs besides PyTorch and the CUDA toolkit, from this (Debian)
# machine's packages, into one folder to carry to a GPU machine that has no Debian packages: the
# header-only libraries (doctest, nlohmann/json, CLI11, Eigen; fmt comes with LibTorch) and the
# fortunes corpus. No binary library: the GPU build leaves SentencePiece out (the byte tokenizer
# needs none), so nothing carried depends on Debian's C library.
#   scripts/gpu-deps.sh [OUT_DIR]      (default .deps/gpu, which git ignores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.deps/gpu}
for h in doctest/doctest.h nlohmann/json.hpp CLI/CLI.hpp eigen3/Eigen/Core; do
  [[ -f /usr/include/$h ]] || { echo "gpu-deps: /usr/include/$h is missing (bash scripts/setup.sh installs it)" >&2; exit 1; }
done
[[ -d /usr/share/games/fortunes ]] || { echo "gpu-deps: the fortunes corpus is missing (bash scripts/setup.sh)" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/include" "$out/fortunes"
cp -r /usr/include/doctest /usr/include/nlohmann /usr/include/CLI /usr/include/eigen3/Eigen "$out/include/"
# Plain-text fortune files only (the loader skips .dat indexes and links anyway).
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$out/fortunes/" \;
du -sh "$out"
