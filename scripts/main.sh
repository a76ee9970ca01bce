#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: trains the default recipe (a small MoE
# language model on the fortunes corpus, 2 data-parallel ranks) into runs/moe-small.
#   scripts/main.sh [key=value overrides and fsdpp run options, e.g. train.steps=200]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
FSDPP_TARGETS=fsdpp_cli scripts/build.sh build  # the trainer alone; test.sh builds the rest
exec build/fsdpp run recipes/moe-small.json --overwrite "$@"
