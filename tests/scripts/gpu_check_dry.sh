#!/usr/bin/env bash
# scripts/gpu-check.sh in its CPU mode (--dry-run): the plumbing that must not fail on a lent GPU
# machine, where a lost result costs device time. --quick, then --rest, as on a lent machine; one
# step of --rest is made to hang (FSDPP_GPU_CHECK_HANG): its timeout ends it, every later step still
# runs, and after the run $OUT holds exactly gpu.md and gpu-logs.tar.gz, with each step's result and
# log. The comparisons run for real (on CPU runs).
#   gpu_check_dry.sh BUILD_DIR
set -u
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fails=0
check() {  # check DESCRIPTION COMMAND...
  if "${@:2}"; then echo "ok: $1"; else echo "FAILED: $1"; fails=$((fails + 1)); fi
}

# As on a lent machine: --quick, then --rest on the same build and report.
quick="build collectives_w1 collectives_w2 graph_pp1 graph_pp2_1f1b"
rest="nccl_core gpu_tests graph_pp2_v parallel speed_small big_torch"
OUT=$out bash "$root/scripts/gpu-check.sh" --quick --dry-run --build-dir "$build" --budget 600 > "$out.log" 2>&1
rc=$?
cat "$out.log"
md=$out/gpu.md
check "--quick passes" test "$rc" -eq 0
check "--quick runs its steps and no other" test "$(grep -cE '^\| [a-z_0-9]+ \| (passed|FAILED|TIMED|not run)' "$md")" -eq 5
for s in $quick; do check "--quick: $s passed" grep -q "^| $s | passed |" "$md"; done
check "eager and graph losses compared step by step" grep -q 'pp1-eager vs pp1-graph: 4 per-step losses bitwise equal' "$md"
check "two ranks' collectives ran, under the NCCL-order check" grep -q 'rank 1/2 ok' "$md"

OUT=$out FSDPP_GPU_CHECK_HANG=big_fsdpp:8 bash "$root/scripts/gpu-check.sh" --rest --dry-run --build-dir "$build" \
  --budget 900 > "$out.log" 2>&1
rc=$?
cat "$out.log"
check "a timed-out step makes the exit status 1" test "$rc" -eq 1
check "\$OUT holds gpu.md and gpu-logs.tar.gz, nothing else" test "$(ls "$out" | tr '\n' ' ')" = "gpu-logs.tar.gz gpu.md "
check "the hanging step is reported as timed out" grep -q '^| big_fsdpp | TIMED OUT after 8 s |' "$md"
check "--rest continues --quick's report" grep -q 'Then: `bash scripts/gpu-check.sh --rest --dry-run`' "$md"
for s in $quick $rest; do
  check "$s passed" grep -q "^| $s | passed |" "$md"
  check "$s's log is in the archive" sh -c "tar -tzf '$out/gpu-logs.tar.gz' | grep -qx 'logs/$s.log'"
done
check "the runs' metrics are in the archive" sh -c "tar -tzf '$out/gpu-logs.tar.gz' | grep -qx 'runs/pp1-graph/metrics/rank0.jsonl'"
check "the V schedule's runs compared" grep -q 'pp2-zbv-eager vs pp2-zbv-graph: 4 per-step losses bitwise equal' "$md"
check "dp 2 with ep 2 against world 1" grep -Eq 'dp2-ep2 vs world1: 4 per-step losses, largest relative difference .* \(within 1e-05\)' "$md"
check "pp 2 against world 1" grep -Eq 'pp2 vs world1: 4 per-step losses, largest relative difference .* \(within 1e-05\)' "$md"
check "the PyTorch baseline ran after fsdpp's run timed out" grep -q '^| PyTorch .* fully_shard |' "$md"
check "no step's process is left" sh -c "! pgrep -f 'gpu-check[.]sh _step' > /dev/null"
rm -f "$out.log"
if ((fails)); then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all checks passed"
