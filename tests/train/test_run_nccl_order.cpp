// `fsdpp run` at the layouts whose communication an NCCL stream orders strictly (pipelines with
// FSDP stages, expert parallelism, both at once, send budgets, overlap groups), once under the
// NCCL-order check (FSDPP_CHECK_NCCL_ORDER=1: Note [NCCL order on the CPU] in
// src/comm/nccl_order.cpp) and once without. The check changes when operations run, not what they
// compute: equal losses, bit for bit, mean that every rank's order is one NCCL runs.
#include <doctest/doctest.h>

#include "train/run_helpers.hpp"

using namespace fsdpp::test;

TEST_CASE("run: dp x pp, ep, pp x ep, budgeted and overlapped V schedules run under NCCL's ordering rules") {
  const std::string common =
      "train.steps=4 train.global_batch=8 logging.interval=1 eval.interval=0 checkpoint.enabled=false";
  for (const std::string layout :
       {"parallel.dp=2 parallel.pp=2 parallel.microbatches=2", "parallel.dp=2 parallel.ep=2",
        "parallel.dp=2 parallel.pp=2 parallel.microbatches=2 parallel.ep=2",
        "model.layers=4 parallel.pp=2 parallel.schedule=ZBVZeroBubble parallel.stages_per_rank=2 "
        "parallel.microbatches=4 parallel.max_outstanding_sends=1",
        "model.layers=4 parallel.pp=2 parallel.schedule=DualPipeV parallel.stages_per_rank=2 "
        "parallel.microbatches=4 parallel.dp=2"}) {
    CAPTURE(layout);
    const auto plain = fresh_dir("order-plain"), checked = fresh_dir("order-checked");
    train_run(plain, common + " " + layout);
    const auto out = train_run(checked, common + " " + layout, "FSDPP_CHECK_NCCL_ORDER=1 ");
    CHECK(out.find("Gloo under NCCL's ordering rules") != std::string::npos);
    const auto a = losses(plain), b = losses(checked);
    CHECK(a.size() == 4);
    CHECK(a == b);
    std::filesystem::remove_all(plain);
    std::filesystem::remove_all(checked);
  }
}
