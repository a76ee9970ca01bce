#include "fsdpp/train/run_lock.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"

namespace fsdpp::train {

namespace {

std::string read_all(int fd) {
  std::string text;
  char buf[4096];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd, buf, sizeof buf, at);
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    at += n;
  }
  return text;
}

// "pid 1234 on host h, started 2026-12-06 16:01:02 UTC (fsdpp run recipes/x.json)", from the file.
std::string describe_holder(const std::string& text) {
  try {
    const auto j = nlohmann::json::parse(text);
    return fmt::format("pid {} on host {}, started {} ({})", j.at("pid").get<int64_t>(),
                       j.at("host").get<std::string>(), j.at("started").get<std::string>(),
                       j.value("command", std::string("?")));
  } catch (const std::exception&) {
    return "a run whose lock file is unreadable";
  }
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char s[32];
  std::strftime(s, sizeof s, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return s;
}

}  // namespace

RunLock RunLock::acquire(const std::string& dir, const std::string& command,
                         std::optional<std::string>* took_over) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error(fmt::format("cannot create the output directory {}: {}", dir, ec.message()));
  const auto path = (std::filesystem::path(dir) / kFileName).string();
  // Never through a link or into a FIFO (a planted link would have its target truncated below).
  int fd = -1;
  try {
    fd = open_for_writing(path, O_RDWR | O_CREAT);
  } catch (const BadInput& e) {
    throw BadInput(fmt::format("cannot claim the output directory {}: {}", dir, e.what()));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("cannot claim the output directory {}: {}", dir, e.what()));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    const std::string holder = read_all(fd);
    ::close(fd);
    if (e == EWOULDBLOCK)
      throw std::runtime_error(
          fmt::format("{} is in use by another run: {}; wait for it to end, or set another "
                      "logging.output_dir",
                      dir, describe_holder(holder)));
    throw std::runtime_error(
        fmt::format("cannot claim the output directory {}: locking {}: {}", dir, path, os_error(e)));
  }
  RunLock lock(fd);
  if (const std::string left = read_all(fd); !left.empty() && took_over)
    *took_over = fmt::format("{}: taking over the claim of a run that ended without releasing it ({})", dir,
                             describe_holder(left));
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string me =
      nlohmann::json{{"pid", ::getpid()}, {"host", host}, {"started", utc_now()}, {"command", command}}
          .dump() +
      "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    const int e = errno;
    throw std::runtime_error(
        fmt::format("cannot claim the output directory {}: writing {}: {}", dir, path, os_error(e)));
  }
  return lock;
}

RunLock::RunLock(RunLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }

RunLock& RunLock::operator=(RunLock&& other) noexcept {
  if (this != &other) {
    this->~RunLock();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

RunLock::~RunLock() {
  if (fd_ < 0) return;
  [[maybe_unused]] const int rc = ::ftruncate(fd_, 0);  // the claim ends: no holder to name
  ::close(fd_);                                         // and the kernel drops the lock
  fd_ = -1;
}

}  // namespace fsdpp::train
