#!/usr/bin/env bash
# What OVERLAP_F_B groups gain: DualPipeV (pp 2, 2 stages per rank, 8 microbatches) on moe-small,
# its groups run by the executor (first the computation whose input is here, each one's sends as
# soon as it is done), against the same plan with every group written as its two actions in order:
#   as 2.15's runtime runs a group: the lowered table, both sends after both computations;
#   in order: the compute table, each computation's send right after it, the plan's order kept.
# Everything else (computations, messages) is the same. 6 interleaved rounds through
# run_knob_bench.sh; writes bench/results/overlap_f_b.md.
#   bash bench/run_overlap_bench.sh [build] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-6}
tables=$(mktemp -d)
trap 'rm -rf "$tables"' EXIT
"$build/fsdpp" schedule show --schedule DualPipeV --pp 2 --stages-per-rank 2 --microbatches 8 \
  --out "$tables/dualpipev" > /dev/null
ungroup='s/\(([0-9]+[FBIW][0-9]+);([0-9]+[FBIW][0-9]+)\)OVERLAP_F_B/\1,\2/g'
sed -E "$ungroup" "$tables/dualpipev.csv" > "$tables/as_torch.csv"
sed -E "$ungroup" "$tables/dualpipev.compute.csv" > "$tables/in_order.csv"
grep -q OVERLAP_F_B "$tables/dualpipev.csv"
! grep -q OVERLAP_F_B "$tables/as_torch.csv" "$tables/in_order.csv"
common="parallel.stages_per_rank=2 parallel.microbatches=8"
FSDPP_BUILD=$build FSDPP_KNOB_RECIPE=recipes/moe-small-pp.json bash bench/run_knob_bench.sh overlap_f_b "$rounds" \
  "groups as 2.15's runtime runs them vs fsdpp's|parallel.schedule=$tables/as_torch.csv $common|parallel.schedule=DualPipeV $common" \
  "groups in order, each send after its computation, vs fsdpp's|parallel.schedule=$tables/in_order.csv $common|parallel.schedule=DualPipeV $common"
