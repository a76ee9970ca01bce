// Note [collateral failures]
// When one rank dies, its peers' pending operations fail a moment later with "connection closed
// by peer", and those peers may even exit before the dead rank has finished exiting. So that the
// launcher can name the rank that failed first rather than the fastest to exit, a rank whose
// operation failed because a peer vanished says so in the file named by FSDPP_ERROR_FILE (set by
// `fsdpp launch`); the launcher treats such ranks as collateral.
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "backend.hpp"

namespace fsdpp::comm::detail {

bool is_peer_loss(const std::string& message) {
  for (const char* s : {"closed by peer", "reset by peer", "Broken pipe", "Connection refused"})
    if (message.find(s) != std::string::npos) return true;
  return false;
}

namespace {

struct AbortHooks {
  std::mutex mu;
  std::vector<std::function<void()>> hooks;
};

AbortHooks& abort_hooks() {
  static auto* h = new AbortHooks;  // used by the watchdog thread, up to the process's end
  return *h;
}

}  // namespace

void add_abort_hook(std::function<void()> hook) {
  auto& h = abort_hooks();
  std::lock_guard<std::mutex> lock(h.mu);
  h.hooks.push_back(std::move(hook));
}

void run_abort_hooks() {
  auto& h = abort_hooks();
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(h.mu);
    hooks = h.hooks;
  }
  for (const auto& hook : hooks) hook();
}

void note_failure(const std::string& what, std::exception_ptr error) {
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "unknown error";
  }
  const char* path = std::getenv("FSDPP_ERROR_FILE");
  if (!path || !*path || !is_peer_loss(message)) return;
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "peer_lost %s: %s\n", what.c_str(), message.c_str());
    std::fclose(f);
  }
}

}  // namespace fsdpp::comm::detail
