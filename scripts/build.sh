#!/usr/bin/env bash
# Configures and builds fsdpp (Release with debug info, Ninja, ccache when present).
#   scripts/build.sh [build-dir] [extra cmake arguments...]
# FSDPP_TARGETS="a b" builds only those targets (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
jobs=${FSDPP_JOBS:-$(nproc)}
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S . -B "$build" -G Ninja "$@"
elif (($#)); then
  cmake -S . -B "$build" "$@"
fi
read -r -a targets <<<"${FSDPP_TARGETS:-}"
cmake --build "$build" -j "$jobs" ${targets[@]+--target "${targets[@]}"}
