#!/usr/bin/env bash
# Installs what fsdpp needs on Debian 12 (run as root). Safe to run again: it installs only
# what is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libgloo-dev
  libopenblas0-pthread            # Debian's LibTorch calls libblas.so.3; without this it is reference BLAS
  libeigen3-dev libfmt-dev nlohmann-json3-dev doctest-dev libcli11-dev
  iproute2 procps                 # network namespaces for the two-node test; ps for orphan checks
  fortunes                        # the default training corpus (/usr/share/games/fortunes)
  python3                         # an independent safetensors reader in the tests
  clang-14 libclang-rt-14-dev     # libFuzzer and the sanitizers for the fuzz tests
)
if [[ "${FSDPP_SETUP_BENCH:-0}" == 1 ]]; then
  packages+=(python3-torch)       # PyTorch's own Gloo process group and DDP, as a baseline
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing packages: ${missing[*]}; run this script as root or install them" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
