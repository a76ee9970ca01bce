#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair, one
# `fsdpp launch --nnodes 2` in each with 2 ranks, rendezvous and collectives across them.
# Exits 77 (reported by ctest as skipped, with the reason printed) where namespaces cannot be made.
set -u
fsdpp=$1
rank_bin=$2
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

launch() {  # node_rank namespace
  FSDPP_TEST_TIMEOUT_MS=30000 ip netns exec "$2" timeout 90 "$fsdpp" launch --nnodes 2 --node-rank "$1" \
    --nproc 2 --master-addr "$addr_a" --master-port "$port" -- "$rank_bin" collectives \
    >"$work/node$1.log" 2>&1
}
launch 0 "$ns_a" & pid_a=$!
launch 1 "$ns_b" & pid_b=$!
wait "$pid_a"; rc_a=$?
wait "$pid_b"; rc_b=$?
echo "--- node 0 ($ns_a, $addr_a), exit $rc_a"; cat "$work/node0.log"
echo "--- node 1 ($ns_b, $addr_b), exit $rc_b"; cat "$work/node1.log"

status=0
[[ $rc_a -eq 0 && $rc_b -eq 0 ]] || { echo "FAIL: a launcher exited non-zero"; status=1; }
for r in 0 1; do
  grep -q "^\[rank$r\]: rank $r/4 ok" "$work/node0.log" || { echo "FAIL: rank $r missing on node 0"; status=1; }
done
for r in 2 3; do
  grep -q "^\[rank$r\]: rank $r/4 ok" "$work/node1.log" || { echo "FAIL: rank $r missing on node 1"; status=1; }
done
[[ $status -eq 0 ]] && echo "PASS: 4 ranks on 2 network namespaces rendezvoused and ran collectives"

# Restarts agree across nodes: rank 2 (node 1) fails on the first start; both launchers start their
# ranks again, and the second start runs everywhere.
restart() {  # node_rank namespace
  FSDPP_TEST_TIMEOUT_MS=30000 ip netns exec "$2" timeout 90 "$fsdpp" launch --nnodes 2 --node-rank "$1" \
    --nproc 2 --master-addr "$addr_a" --master-port $((port + 1)) --max-restarts 1 -- "$rank_bin" exit-first 3 2 \
    >"$work/restart$1.log" 2>&1
}
restart 0 "$ns_a" & pid_a=$!
restart 1 "$ns_b" & pid_b=$!
wait "$pid_a"; rc_a=$?
wait "$pid_b"; rc_b=$?
echo "--- restart: node 0, exit $rc_a"; cat "$work/restart0.log"
echo "--- restart: node 1, exit $rc_b"; cat "$work/restart1.log"
[[ $rc_a -eq 0 && $rc_b -eq 0 ]] || { echo "FAIL: a launcher exited non-zero after the restart"; status=1; }
for node in 0 1; do
  grep -q "fsdpp launch: restart 1 of 1: .*rank 2 (pid [0-9]*) exited with code 3" "$work/restart$node.log" ||
    { echo "FAIL: node $node did not restart for rank 2's failure"; status=1; }
done
for r in 0 1; do
  grep -q "^\[rank$r\]: restart 1: rank $r/4 ok" "$work/restart0.log" || { echo "FAIL: rank $r not ok after the restart"; status=1; }
done
for r in 2 3; do
  grep -q "^\[rank$r\]: restart 1: rank $r/4 ok" "$work/restart1.log" || { echo "FAIL: rank $r not ok after the restart"; status=1; }
done
[[ $status -eq 0 ]] && echo "PASS: a failure on node 1 restarted both nodes, and the second start ran everywhere"
exit $status
