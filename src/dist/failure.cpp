// Note [collateral failures]
// When one rank dies, its peers' pending operations fail a moment later with "connection closed
// by peer", and those peers may even exit before the dead rank has finished exiting. So that the
// launcher can name the rank that failed first rather than the fastest to exit, a rank whose
// operation failed because a peer vanished says so in the file named by FSDPP_ERROR_FILE (set by
// `fsdpp launch`); the launcher treats such ranks as collateral.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "backend.hpp"

namespace fsdpp::dist::detail {

bool is_peer_loss(const std::string& message) {
  for (const char* s : {"closed by peer", "reset by peer", "Broken pipe", "Connection refused"})
    if (message.find(s) != std::string::npos) return true;
  return false;
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

}  // namespace fsdpp::dist::detail
