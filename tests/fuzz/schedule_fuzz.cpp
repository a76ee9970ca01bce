// libFuzzer target: schedule tables as `fsdpp schedule show --csv` and parallel.schedule read them.
// The first byte picks CSV or JSON, pp, FSDP stages and a send budget; the rest is the table. It is
// parsed, then planned (validated, lowered, simulated) at a few microbatch counts. Refusing with
// ScheduleError is the expected outcome; any other exception, a crash, a sanitizer report or a
// plan that takes seconds is a finding.
#include <cstdint>
#include <sstream>
#include <string>

#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/table.hpp"

using namespace fsdpp::pipeline;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  const bool json = mode & 1, fsdp = mode & 2;
  const int pp = 1 + ((mode >> 2) & 3), budget = (mode >> 4) & 3;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data) + 1, size - 1));
  try {
    Positions where;
    const TableSchedule table("fuzz", json ? parse_json_table(in, &where) : parse_csv(in, &where), where);
    for (const int microbatches : {1, 2, 4})
      for (const int stages_per_rank : {1, 2}) try {
          (void)make_plan(table, {.pp = pp, .stages_per_rank = stages_per_rank, .microbatches = microbatches},
                          {.fsdp_stages = fsdp, .max_outstanding_sends = budget});
        } catch (const ScheduleError&) {
          continue;  // refused at this size: another may fit the table
        }
  } catch (const ScheduleError&) {
    return 0;  // a malformed table, refused
  }
  return 0;
}
