#!/usr/bin/env bash
# Installs fsdpp into a temporary prefix, builds tests/package against it with find_package, and
# runs the result on 3 ranks.
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
# Every header lands under include/fsdpp/, nothing at the top of the include directory.
others=$(ls "$tmp/prefix/include" | grep -vx fsdpp || true)
[[ -z $others ]] || { echo "FAIL: installed outside include/fsdpp/: $others"; exit 1; }
cmake -S "$src" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
out=$("$build/fsdpp" launch --nproc 3 -- "$tmp/consumer/consumer")
echo "$out"
for r in 0 1 2; do
  grep -q "consumer rank $r sum 6" <<<"$out" || { echo "FAIL: rank $r did not print sum 6"; exit 1; }
done
# Linking fsdpp::mkl_kernels is what asks MKL for its kernels by instruction set: the answer comes
# from libfsdpp_mkl_kernels.so, which fsdpp::mkl_dispatch() finds in the process.
mkl=$("$tmp/consumer/consumer_mkl")
echo "$mkl"
grep -q "asked=1" <<<"$mkl" || { echo "FAIL: consumer_mkl links fsdpp::mkl_kernels, but fsdpp does not see it"; exit 1; }
echo "PASS: an installed fsdpp works through find_package(fsdpp)"
