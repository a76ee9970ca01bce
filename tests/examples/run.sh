#!/usr/bin/env bash
# Runs the example programs as the README says, on 2 ranks, and checks that they did their job.
#   tests/examples/run.sh BUILD_DIR
set -euo pipefail
build=$1
out=$("$build/fsdpp" launch --nproc 2 -- "$build/example_train_fully_shard")
echo "$out"
# The sharded model fits its regression target: the last reported loss is far below the first.
python3 - "$out" <<'PY'
import re, sys
losses = [float(x) for x in re.findall(r"\[rank0\]: step \d+: loss (\S+)", sys.argv[1])]
assert len(losses) == 4, losses
assert losses[-1] < losses[0] / 100, losses
PY
out=$("$build/fsdpp" launch --nproc 2 -- "$build/example_custom_schedule")
echo "$out"
grep -q "Eager1F1B: bubble" <<<"$out"
python3 - "$out" <<'PY'
import re, sys
losses = [float(x) for x in re.findall(r"\[rank1\]: step \d+: loss (\S+)", sys.argv[1])]
assert len(losses) == 3 and losses[-1] < losses[0], losses
PY
echo "PASS: both examples ran and trained"
