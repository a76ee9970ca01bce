#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: an all-reduce check and bandwidth table
# across local ranks over Gloo.
#   scripts/main.sh [fsdpp demo options, e.g. --nproc 4]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
exec build/fsdpp demo "$@"
