// `fsdpp launch` with real processes: exit codes, signals, Ctrl-C, no orphans, rendezvous errors.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fsdpp/comm/launch.hpp"

namespace {

struct Run {
  int status = -1;  // exit code, or 128 + signal
  std::string output;
  double seconds = 0;
};

std::string unique_token() {
  std::random_device rd;
  return "fsdpp-test-token-" + std::to_string(getpid()) + "-" + std::to_string(rd());
}

Run run(const std::string& cmd) {
  Run r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// Processes whose command line contains `token`, read from the process table.
std::vector<int> processes_with(const std::string& token) {
  std::vector<int> pids;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const auto name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (cmdline.find(token) != std::string::npos && std::stoi(name) != getpid())
      pids.push_back(std::stoi(name));
  }
  return pids;
}

// A listening TCP socket, decoded from /proc/net/tcp or tcp6.
struct Listener {
  std::string address;
  int port = 0;
  bool loopback = false;
};

// The listening TCP sockets that `pids` hold.
std::vector<Listener> listeners_of(const std::vector<int>& pids) {
  std::set<std::string> inodes;
  for (int pid : pids) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
      const auto target = std::filesystem::read_symlink(e.path(), ec).string();
      if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  std::vector<Listener> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream f(table);
    std::string line;
    std::getline(f, line);  // header
    while (std::getline(f, line)) {
      std::istringstream in(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      in >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state != "0A" || !inodes.count(inode)) continue;  // 0A: LISTEN
      const auto colon = local.find(':');
      const std::string hex = local.substr(0, colon);
      Listener l;
      l.port = std::stoi(local.substr(colon + 1), nullptr, 16);
      l.address = hex;
      // IPv4: one little-endian word, first octet in the last two hex digits. IPv6: four words;
      // ::1 is 0...0 01000000, a mapped 127.x.y.z ends in 0000FFFF then the IPv4 word.
      if (hex.size() == 8)
        l.loopback = hex.substr(6, 2) == "7F";
      else
        l.loopback = hex == "00000000000000000000000001000000" ||
                     (hex.substr(16, 8) == "FFFF0000" && hex.substr(30, 2) == "7F");
      out.push_back(l);
    }
  }
  return out;
}

// An IPv4 address of this machine that is not loopback, if it has one.
std::optional<std::string> outside_address() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (auto* a = list; a && !found; a = a->ifa_next)
    if (a->ifa_addr && a->ifa_addr->sa_family == AF_INET && (a->ifa_flags & IFF_UP) &&
        !(a->ifa_flags & IFF_LOOPBACK)) {
      char text[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
      found = text;
    }
  freeifaddrs(list);
  return found;
}

// Whether a TCP connection to address:port is accepted.
bool accepts(const std::string& address, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, address.c_str(), &a.sin_addr);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

const std::string kLaunch = std::string(FSDPP_BIN) + " launch";
const std::string kRank = FSDPP_TEST_RANK_BIN;

}  // namespace

TEST_CASE("collectives across 4 real processes, output prefixed with the rank") {
  const auto r = run(kLaunch + " --nproc 4 -- " + kRank + " collectives");
  INFO(r.output);
  CHECK(r.status == 0);
  for (int i = 0; i < 4; ++i)
    CHECK(r.output.find("[rank" + std::to_string(i) + "]: rank " + std::to_string(i) + "/4 ok") !=
          std::string::npos);
}

TEST_CASE("a rank that exits 3 makes the launch exit 3 within 10 s, leaving no process") {
  const auto token = unique_token();
  const auto r = run(kLaunch + " --nproc 3 -- " + kRank + " exit 3 1 " + token);
  INFO(r.output);
  CHECK(r.status == 3);
  CHECK(r.seconds < 10);
  CHECK(r.output.find("rank 1 (pid ") != std::string::npos);
  CHECK(r.output.find("exited with code 3") != std::string::npos);
  CHECK(processes_with(token).empty());
}

TEST_CASE("a rank killed with SIGKILL is reported as such, and the others are stopped") {
  const auto token = unique_token();
  const auto r = run(kLaunch + " --nproc 3 -- " + kRank + " kill 2 " + token);
  INFO(r.output);
  CHECK(r.status == 128 + SIGKILL);
  CHECK(r.seconds < 10);
  CHECK(r.output.find("rank 2 (pid ") != std::string::npos);
  CHECK(r.output.find("was killed by SIGKILL") != std::string::npos);
  CHECK(processes_with(token).empty());
}

TEST_CASE(
    "a single-node job listens on loopback only, and Ctrl-C (SIGINT to the launcher) stops every rank") {
  const auto token = unique_token();
  const auto log = std::filesystem::temp_directory_path() / (token + ".log");
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    execl(FSDPP_BIN, FSDPP_BIN, "launch", "--nproc", "2", "--", kRank.c_str(), "sleep", token.c_str(),
          nullptr);
    _exit(127);
  }
  auto read_log = [&] {
    std::ifstream f(log);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  // Wait until both ranks are up and sleeping.
  for (int i = 0; i < 300; ++i) {
    const auto text = read_log();
    if (text.find("[rank0]: ready") != std::string::npos && text.find("[rank1]: ready") != std::string::npos)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  REQUIRE(processes_with(token).size() == 3);  // the launcher and its two ranks
  // A single-node job listens on loopback only: the store (hosted by the launcher) and anything a
  // rank listens on cannot be reached from the network (Note [store bind address]).
  const auto listening = listeners_of(processes_with(token));
  CHECK(!listening.empty());
  for (const auto& l : listening) {
    INFO("listening on " << l.address << ":" << l.port);
    CHECK(l.loopback);
    CHECK(accepts("127.0.0.1", l.port));
    if (const auto outside = outside_address()) {
      INFO("this machine's address " << *outside);
      CHECK_FALSE(accepts(*outside, l.port));
    } else {
      MESSAGE("this machine has no IPv4 address besides loopback; the listening addresses were checked");
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(read_log());
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 128 + SIGINT);
  CHECK(secs < 10);
  CHECK(read_log().find("got SIGINT, stopping all ranks") != std::string::npos);
  CHECK(processes_with(token).empty());
  std::filesystem::remove(log);
}

TEST_CASE("a rank started alone fails at init naming the missing rank, not a hang") {
  // Rank 0 of 2 with nobody else: it hosts the store, waits, and gives up after the timeout.
  const auto r =
      run("env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29731 "
          "FSDPP_TEST_TIMEOUT_MS=2000 " +
          kRank + " collectives");
  INFO(r.output);
  CHECK(r.status == 2);
  CHECK(r.seconds < 10);
  CHECK(r.output.find("rank 0 of 2: rendezvous through 127.0.0.1:29731 timed out") != std::string::npos);
  CHECK(r.output.find("missing rank(s) 1") != std::string::npos);
}

TEST_CASE("a wrong store address fails at init, naming the rank and the address") {
  // Rank 1 looks for a store that nobody hosts.
  const auto r =
      run("env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29733 "
          "FSDPP_TEST_TIMEOUT_MS=2000 " +
          kRank + " collectives");
  INFO(r.output);
  CHECK(r.status == 2);
  CHECK(r.seconds < 10);
  CHECK(r.output.find("rank 1 of 2: cannot reach the rendezvous store at 127.0.0.1:29733") !=
        std::string::npos);
}

TEST_CASE("launch rejects inconsistent options before starting anything") {
  auto r = run(kLaunch + " --nproc 2 --nnodes 2 -- /bin/true");
  CHECK(r.status != 0);
  CHECK(r.output.find("--master-addr and --master-port") != std::string::npos);
  r = run(kLaunch + " --nproc 2 -- no-such-program-fsdpp");
  CHECK(r.status != 0);
  CHECK(r.output.find("program 'no-such-program-fsdpp' not found") != std::string::npos);
}

TEST_CASE("launch gives every rank the environment entries it is handed, in place of the launcher's own") {
  const auto dir = std::filesystem::temp_directory_path() / ("fsdpp-launch-env-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  setenv("FSDPP_TEST_ENV", "launcher", 1);
  fsdpp::comm::LaunchOptions o;
  o.nproc = 2;
  o.prefix_output = false;
  o.env = {"FSDPP_TEST_ENV=rank", "FSDPP_TEST_OTHER=x=y"};
  o.command = {"/bin/sh", "-c", "env > " + dir.string() + "/env-$RANK"};
  const auto result = fsdpp::comm::launch(o);
  unsetenv("FSDPP_TEST_ENV");
  REQUIRE(result.exit_code == 0);
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    std::ifstream f(dir / ("env-" + std::to_string(rank)));
    std::vector<std::string> seen;
    for (std::string line; std::getline(f, line);)
      if (line.rfind("FSDPP_TEST_", 0) == 0) seen.push_back(line);
    std::sort(seen.begin(), seen.end());
    CHECK(seen == std::vector<std::string>{"FSDPP_TEST_ENV=rank", "FSDPP_TEST_OTHER=x=y"});
  }
  std::filesystem::remove_all(dir);
  o.env = {"NO_EQUALS_SIGN"};
  CHECK_THROWS_WITH_AS(fsdpp::comm::launch(o),
                       "fsdpp launch: environment entry 'NO_EQUALS_SIGN' is not NAME=value",
                       std::invalid_argument);
}

TEST_CASE(
    "fsdpp schedule show: timeline, bubble and files for a valid schedule; the reason for an invalid one") {
  const auto dir = std::filesystem::temp_directory_path() / unique_token();
  std::filesystem::create_directories(dir);
  auto r = run(std::string(FSDPP_BIN) + " schedule show --schedule 1F1B --pp 4 --microbatches 8 --out " +
               (dir / "s").string());
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("mean bubble fraction 0.273") != std::string::npos);  // (p-1)/(m+p-1) = 3/11
  for (const char* ext : {".svg", ".trace.json", ".csv"})
    CHECK(std::filesystem::file_size(dir / (std::string("s") + ext)) > 0);
  std::ofstream(dir / "bad.csv") << "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n";
  r = run(std::string(FSDPP_BIN) + " schedule show --csv " + (dir / "bad.csv").string() +
          " --pp 2 --microbatches 2 --out " + (dir / "b").string());
  CHECK(r.status != 0);
  CHECK(r.output.find("the schedule deadlocks: rank 0 at 0B0") != std::string::npos);
  CHECK(r.output.find("rank 1 at 1F1") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a rank that skips an all_gather: every rank dumps its flight records and the analysis names it") {
  const auto dir = std::filesystem::temp_directory_path() / (unique_token() + "-fr");
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run("env FSDPP_WATCHDOG_TIMEOUT_S=1 FSDPP_FR_DUMP_DIR=" + dir.string() +
                     " FSDPP_TEST_TIMEOUT_MS=6000 " + kLaunch + " --nproc 4 -- " + kRank + " hang 1");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(secs < 6 + 10);  // the operation timeout, plus the launcher's grace
  for (int rank = 0; rank < 4; ++rank)
    CHECK(std::filesystem::exists(dir / ("rank" + std::to_string(rank) + ".json")));
  CHECK(r.output.find("fsdpp watchdog: rank 0:") != std::string::npos);
  const auto a = run(std::string(FSDPP_BIN) + " fr analyze " + dir.string());
  INFO(a.output);
  CHECK(a.status == 0);
  // Rank 1's all_gather of layers.2 met the others' layers.1: the first disagreement.
  CHECK(a.output.find(
            "at operation 1, rank(s) 1 issued all_gather Float in=4 out=16 ('fsdp all_gather layers.2') "
            "where rank(s) 0, 2, 3 issued all_gather Float in=4 out=16 ('fsdp all_gather layers.1')") !=
        std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a program that asks for neither gets no fault and no watchdog from its environment") {
  const auto dir = std::filesystem::temp_directory_path() / (unique_token() + "-env");
  // Rank 1 would skip its second labelled all_gather; rank 0 joins the third a second late, past a
  // 0.3 s watchdog.
  const std::string env =
      "env FSDPP_FAULT=skip_all_gather:rank=1:count=2 FSDPP_WATCHDOG_TIMEOUT_S=0.3 "
      "FSDPP_FR_DUMP_DIR=" +
      dir.string() + " FSDPP_TEST_TIMEOUT_MS=6000 ";
  const auto plain = run(env + kLaunch + " --nproc 2 -- " + kRank + " env");
  INFO(plain.output);
  CHECK(plain.status == 0);
  CHECK(plain.output.find("rank 0/2 env ok") != std::string::npos);
  CHECK(plain.output.find("rank 1/2 env ok") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir));
  // The same program asking (as the CLI does): the fault acts, and, without it, the watchdog (rank 1
  // waits a second for rank 0's third all_gather).
  const auto faulted = run(env + kLaunch + " --nproc 2 -- " + kRank + " env ask");
  INFO(faulted.output);
  CHECK(faulted.status != 0);
  CHECK(faulted.output.find("[rank1]: FAILED: all_gather 1 did not gather") != std::string::npos);
  const auto watched = run("env FSDPP_WATCHDOG_TIMEOUT_S=0.3 FSDPP_FR_DUMP_DIR=" + dir.string() +
                           " FSDPP_TEST_TIMEOUT_MS=6000 " + kLaunch + " --nproc 2 -- " + kRank + " env ask");
  INFO(watched.output);
  CHECK(watched.status != 0);
  CHECK(watched.output.find("fsdpp watchdog: rank 1:") != std::string::npos);
  CHECK(std::filesystem::exists(dir / "rank1.json"));
  std::filesystem::remove_all(dir);
}
