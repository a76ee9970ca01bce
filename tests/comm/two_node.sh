#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair, one
# `fsdpp launch --nnodes 2` in each with 2 ranks: rendezvous and collectives across them, restarts
# agreed across nodes, and training with checkpoints on each node's own storage (a directory per
# node). Usage: two_node.sh FSDPP RANK_PROGRAM RECIPE
# Exits 77 (reported by ctest as skipped, with the reason printed) where namespaces cannot be made.
set -u
fsdpp=$1
rank_bin=$2
recipe=$3
id=$$
ns_a=fsdpp-a-$id ns_b=fsdpp-b-$id
dev_a=fa$id dev_b=fb$id
addr_a=10.213.0.1 addr_b=10.213.0.2
port=29611
work=$(mktemp -d)

skip() { echo "SKIPPED: two-node test: $*"; exit 77; }
cleanup() {
  ip netns del "$ns_a" 2>/dev/null
  ip netns del "$ns_b" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

[[ $(id -u) -eq 0 ]] || skip "creating network namespaces needs root"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
ip netns add "$ns_a" 2>"$work/err" || skip "cannot create a network namespace: $(cat "$work/err")"
ip netns add "$ns_b" 2>"$work/err" || skip "cannot create a network namespace: $(cat "$work/err")"
ip link add "$dev_a" type veth peer name "$dev_b" 2>"$work/err" || skip "cannot create a veth pair: $(cat "$work/err")"
ip link set "$dev_a" netns "$ns_a"
ip link set "$dev_b" netns "$ns_b"
ip -n "$ns_a" addr add "$addr_a/24" dev "$dev_a"
ip -n "$ns_b" addr add "$addr_b/24" dev "$dev_b"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
ip -n "$ns_a" link set "$dev_a" up
ip -n "$ns_b" link set "$dev_b" up

# both NAME PORT_OFFSET ARGS...: one `fsdpp launch --nnodes 2 --nproc 2` per node, ARGS after its
# addressing options ("{node}" in them becomes the node's rank); their output goes to
# $work/NAME<node>.log, their exit codes to rc_a and rc_b.
both() {
  local name=$1 offset=$2 node ns pids=()
  shift 2
  for node in 0 1; do
    ns=$ns_a
    [[ $node -eq 1 ]] && ns=$ns_b
    FSDPP_TEST_TIMEOUT_MS=30000 ip netns exec "$ns" timeout 120 "$fsdpp" launch --nnodes 2 --node-rank "$node" \
      --nproc 2 --master-addr "$addr_a" --master-port $((port + offset)) "${@//\{node\}/$node}" \
      >>"$work/$name$node.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[0]}"; rc_a=$?
  wait "${pids[1]}"; rc_b=$?
}
both node 0 -- "$rank_bin" collectives
echo "--- node 0 ($ns_a, $addr_a), exit $rc_a"; cat "$work/node0.log"
echo "--- node 1 ($ns_b, $addr_b), exit $rc_b"; cat "$work/node1.log"

# all_ok NAME PREFIX WHEN: every rank printed "PREFIXrank r/4 ok" in its node's NAME log.
all_ok() {
  local r
  for r in 0 1 2 3; do
    grep -q "^\[rank$r\]: $2rank $r/4 ok" "$work/$1$((r / 2)).log" || { echo "FAIL: rank $r not ok $3"; status=1; }
  done
}

status=0
[[ $rc_a -eq 0 && $rc_b -eq 0 ]] || { echo "FAIL: a launcher exited non-zero"; status=1; }
all_ok node "" "in the first run"
[[ $status -eq 0 ]] && echo "PASS: 4 ranks on 2 network namespaces rendezvoused and ran collectives"

# Restarts agree across nodes: rank 2 (node 1) fails on the first start; both launchers start their
# ranks again, and the second start runs everywhere.
both restart 1 --max-restarts 1 -- "$rank_bin" exit-first 3 2
echo "--- restart: node 0, exit $rc_a"; cat "$work/restart0.log"
echo "--- restart: node 1, exit $rc_b"; cat "$work/restart1.log"
[[ $rc_a -eq 0 && $rc_b -eq 0 ]] || { echo "FAIL: a launcher exited non-zero after the restart"; status=1; }
for node in 0 1; do
  grep -q "fsdpp launch: restart 1 of 1: .*rank 2 (pid [0-9]*) exited with code 3" "$work/restart$node.log" ||
    { echo "FAIL: node $node did not restart for rank 2's failure"; status=1; }
done
all_ok restart "restart 1: " "after the restart"
[[ $status -eq 0 ]] && echo "PASS: a failure on node 1 restarted both nodes, and the second start ran everywhere"

# Checkpoints on local storage: each node writes its own ranks' files to its own directory. Rank 2
# (node 1) is killed while it writes the step-8 checkpoint: no node commits step 8, and both
# resume from step 4.
train=(-- "$fsdpp" run "$recipe" logging.output_dir="$work/local{node}" parallel.dp=4 train.global_batch=8
       train.steps=12 checkpoint.interval=4 checkpoint.storage=local)
FSDPP_FAULT=kill_in_checkpoint:rank=2:step=8 both local 2 "${train[@]}"
echo "--- local storage, killed in the step-8 checkpoint: node 0 exit $rc_a, node 1 exit $rc_b"
[[ $rc_a -ne 0 && $rc_b -ne 0 ]] || { echo "FAIL: the run did not stop"; status=1; }
for node in 0 1; do
  ckpt=$work/local$node/checkpoints
  [[ $(cat "$ckpt/latest" 2>/dev/null) == step-00000004 ]] || { echo "FAIL: node $node's latest is not step 4"; status=1; }
  [[ ! -e $ckpt/step-00000008 ]] || { echo "FAIL: node $node committed step 8"; status=1; }
done
[[ -f $work/local0/checkpoints/step-00000004/rank1.safetensors && ! -e $work/local0/checkpoints/step-00000004/rank2.json &&
   -f $work/local1/checkpoints/step-00000004/rank2.safetensors && ! -e $work/local1/checkpoints/step-00000004/rank1.json ]] ||
  { echo "FAIL: each node should hold its own ranks' files only"; ls -R "$work/local0/checkpoints" "$work/local1/checkpoints"; status=1; }
"$fsdpp" ckpt verify "$work/local1" >"$work/verify.log" 2>&1 || { echo "FAIL: node 1's checkpoints do not verify"; cat "$work/verify.log"; status=1; }
both local 3 "${train[@]}" --resume
echo "--- local storage, resumed: node 0 exit $rc_a, node 1 exit $rc_b"; cat "$work/local0.log" "$work/local1.log" | grep -v "^\[rank[0-9]\]: step "
[[ $rc_a -eq 0 && $rc_b -eq 0 ]] || { echo "FAIL: --resume on local storage failed"; status=1; }
grep -q "resumed from $work/local0/checkpoints/step-00000004" "$work/local0.log" || { echo "FAIL: not resumed from step 4"; status=1; }
for node in 0 1; do
  [[ $(cat "$work/local$node/checkpoints/latest" 2>/dev/null) == step-00000012 ]] || { echo "FAIL: node $node did not commit step 12"; status=1; }
done
# One file of full parameters from both nodes' directories; one node's alone is refused.
"$fsdpp" ckpt consolidate "$work/local0" "$work/local1" -o "$work/model.safetensors" >"$work/consolidate.log" 2>&1 ||
  { echo "FAIL: consolidate of both nodes' directories"; cat "$work/consolidate.log"; status=1; }
if "$fsdpp" ckpt consolidate "$work/local0" -o "$work/half.safetensors" >"$work/half.log" 2>&1 ||
   ! grep -q "rank2.json is missing" "$work/half.log"; then
  echo "FAIL: consolidating one node's directory should name the missing rank files"; cat "$work/half.log"; status=1
fi
[[ $status -eq 0 ]] && echo "PASS: checkpoints on each node's own storage: killed mid-write, both nodes kept step 4, resumed, consolidated"
exit $status
