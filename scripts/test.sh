#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (the slow multi-process ones last).
#   scripts/test.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
scripts/setup.sh
scripts/build.sh "$build"
ctest --test-dir "$build" --output-on-failure --timeout 900
