// `fsdpp launch`: local ranks as child processes, torchrun's environment, fail-fast supervision.
//
// Note [process groups and Ctrl-C]
// Each rank runs in its own process group, so a terminal's SIGINT reaches only the launcher, which
// then stops every rank the same way it stops them after a failure (SIGTERM, then SIGKILL after
// the grace period). Killing the whole group also takes any helper processes a rank started. A
// rank whose launcher dies gets SIGKILL from the kernel (PR_SET_PDEATHSIG), so nothing outlives a
// killed launcher either.
#include "fsdpp/comm/launch.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <thread>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/comm/store.hpp"

extern char** environ;

namespace fsdpp::comm {

namespace {

std::atomic<int> g_signal{0};
int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  g_signal.store(sig);
  const char c = 1;
  [[maybe_unused]] auto n = write(g_signal_pipe[1], &c, 1);
}

std::string resolve_program(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    // Checked here, where the reason can be told: after fork, exec's failure can only be counted.
    struct stat st {};
    if (::stat(name.c_str(), &st) != 0)
      throw std::invalid_argument(fmt::format("fsdpp launch: program {}: {}", name, strerror(errno)));
    if (!S_ISREG(st.st_mode))
      throw std::invalid_argument(fmt::format("fsdpp launch: program {} is not a regular file", name));
    if (access(name.c_str(), X_OK) != 0)
      throw std::invalid_argument(
          fmt::format("fsdpp launch: program {} is not executable ({})", name, strerror(errno)));
    return name;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string candidate = dirs.substr(start, end - start) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  throw std::invalid_argument(fmt::format("fsdpp launch: program '{}' not found in PATH", name));
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

struct Rank {
  int global_rank = 0;
  std::string error_file;  // see Note [collateral failures] in failure.cpp
  pid_t pid = -1;
  bool running = true;
  int fds[2] = {-1, -1};  // stdout, stderr pipes (read ends)
  std::string partial[2];
};

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += n;
  }
}

// Forwards complete lines from a rank's pipe, each with the rank's prefix.
void forward(Rank& r, int stream, const char* data, size_t n, bool prefix, bool flush) {
  std::string& buf = r.partial[stream];
  buf.append(data, n);
  const std::string tag = prefix ? fmt::format("[rank{}]: ", r.global_rank) : "";
  std::string out;
  size_t start = 0, nl;
  // A carriage return ends a segment too, so that progress bars redrawn in place pass through.
  while ((nl = buf.find_first_of("\n\r", start)) != std::string::npos) {
    out += tag;
    out.append(buf, start, nl - start + 1);
    start = nl + 1;
  }
  buf.erase(0, start);
  if (flush && !buf.empty()) {
    out += tag + buf + "\n";
    buf.clear();
  }
  if (!out.empty()) write_all(stream == 0 ? STDOUT_FILENO : STDERR_FILENO, out);
}

struct Failure {
  int rank;
  int exit_code;
  std::string reason;
};

Failure describe_exit(const Rank& r, int status) {
  if (WIFSIGNALED(status))
    return {r.global_rank, 128 + WTERMSIG(status),
            fmt::format("rank {} (pid {}) was killed by {}", r.global_rank, r.pid,
                        signal_name(WTERMSIG(status)))};
  return {r.global_rank, WEXITSTATUS(status),
          fmt::format("rank {} (pid {}) exited with code {}", r.global_rank, r.pid, WEXITSTATUS(status))};
}

// Ranks of this node that are stopped (SIGSTOP, a debugger): a collective waits on them forever,
// and the first rank to fail is whichever watchdog fires, not the cause.
std::string stopped_ranks(const std::vector<Rank>& ranks) {
  std::vector<std::string> stopped;
  for (const auto& r : ranks) {
    if (!r.running) continue;
    std::ifstream f(fmt::format("/proc/{}/stat", r.pid));
    std::string line;
    std::getline(f, line);
    // pid (comm) state ...: the state follows the last ')'.
    const auto close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() &&
        (line[close + 2] == 'T' || line[close + 2] == 't'))
      stopped.push_back(fmt::format("rank {} (pid {})", r.global_rank, r.pid));
  }
  if (stopped.empty()) return "";
  return fmt::format(
      "; {} {} stopped (SIGSTOP or a debugger) and so never reached the collective: the likely cause",
      fmt::join(stopped, ", "), stopped.size() == 1 ? "is" : "are");
}

bool lost_a_peer(const Rank& r) {
  std::error_code ec;
  return std::filesystem::file_size(r.error_file, ec) > 0 && !ec;
}

pid_t spawn(const std::string& program, const std::vector<std::string>& args,
            const std::vector<std::string>& env, int out_fd, int err_fd, pid_t parent) {
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fsdpp launch: fork failed: {}", strerror(errno)));
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(out_fd, STDOUT_FILENO);
    dup2(err_fd, STDERR_FILENO);
    signal(SIGPIPE, SIG_DFL);
    execve(program.c_str(), argv.data(), envp.data());
    const char msg[] = "fsdpp launch: exec of the rank's program failed (it was there a moment ago)\n";
    [[maybe_unused]] auto n = write(STDERR_FILENO, msg, sizeof(msg) - 1);
    _exit(127);
  }
  setpgid(pid, pid);  // also from the parent, so that killpg works before the child runs
  return pid;
}

std::vector<std::string> rank_env(const LaunchOptions& o, const std::string& addr, uint16_t port,
                                  int local_rank, const std::string& error_file, int attempt) {
  static const char* kOwned[] = {"RANK",
                                 "WORLD_SIZE",
                                 "LOCAL_RANK",
                                 "LOCAL_WORLD_SIZE",
                                 "GROUP_RANK",
                                 "MASTER_ADDR",
                                 "MASTER_PORT",
                                 "TORCHELASTIC_USE_AGENT_STORE",
                                 "TORCHELASTIC_RESTART_COUNT",
                                 "FSDPP_ERROR_FILE"};
  std::vector<std::string> env;
  bool has_omp = false;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    const std::string key = kv.substr(0, kv.find('='));
    bool owned = false;
    for (const char* k : kOwned) owned |= key == k;
    for (const auto& given : o.env) owned |= given.compare(0, key.size() + 1, key + "=") == 0;
    has_omp |= key == "OMP_NUM_THREADS";
    owned |= o.share_gpu && key == "NCCL_HOSTID";
    if (!owned) env.push_back(std::move(kv));
  }
  const int world = o.nnodes * o.nproc;
  env.push_back(fmt::format("RANK={}", o.node_rank * o.nproc + local_rank));
  env.push_back(fmt::format("WORLD_SIZE={}", world));
  env.push_back(fmt::format("LOCAL_RANK={}", local_rank));
  env.push_back(fmt::format("LOCAL_WORLD_SIZE={}", o.nproc));
  // The ranks' output reaches a terminal through the launcher's pipes; tell them whether it does.
  if (!std::getenv("FSDPP_STDOUT_TTY"))
    env.push_back(fmt::format("FSDPP_STDOUT_TTY={}", isatty(STDOUT_FILENO) ? 1 : 0));
  env.push_back(fmt::format("GROUP_RANK={}", o.node_rank));
  env.push_back("MASTER_ADDR=" + addr);
  env.push_back(fmt::format("MASTER_PORT={}", port));
  env.push_back("TORCHELASTIC_USE_AGENT_STORE=True");  // node 0's launcher hosts the store
  // Which start of the group this is (0, then 1 after the first restart), as torchrun says it: the
  // ranks rendezvous under keys of their own, and the trainer resumes from its latest checkpoint.
  env.push_back(fmt::format("TORCHELASTIC_RESTART_COUNT={}", attempt));
  env.push_back("FSDPP_ERROR_FILE=" + error_file);
  // As torchrun does: ranks sharing a node should not each spawn a thread per core.
  if (!has_omp && o.nproc > 1) env.push_back("OMP_NUM_THREADS=1");
  if (o.share_gpu) {
    // Distinct host ids pass NCCL's check for two ranks on one GPU (LaunchOptions::share_gpu).
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    env.push_back(fmt::format("NCCL_HOSTID={}-fsdpp-rank{}", host, local_rank));
    for (const char* kv : {"NCCL_SOCKET_IFNAME=lo", "NCCL_IB_DISABLE=1"}) {
      const std::string key(kv, std::strchr(kv, '='));
      if (!std::getenv(key.c_str())) env.push_back(kv);
    }
  }
  env.insert(env.end(), o.env.begin(), o.env.end());
  return env;
}

}  // namespace

namespace {

// What one start of the local ranks needs beyond the options.
struct Attempt {
  int number = 0;  // 0, then 1 after the first restart
  std::string program, addr, error_dir;
  uint16_t port = 0;
  // With several nodes and restarts: the job's store, through which a failure on one node stops
  // (and restarts) the ranks on every node.
  std::shared_ptr<Store> store;
  bool interrupted = false;  // set when a signal stopped the ranks (never restarted)
};

std::string failure_key(int attempt) { return fmt::format("fsdpp/launch/{}/failed", attempt); }

// The failure a node's launcher published for this attempt ("<exit code>|<reason>"), if any. A
// store that is gone (node 0's launcher ended) has nothing more to say.
std::optional<Failure> published_failure(Store* store, int attempt) {
  std::vector<uint8_t> v;
  try {
    if (!store || !store->check({failure_key(attempt)})) return std::nullopt;
    v = store->get(failure_key(attempt));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const std::string text(v.begin(), v.end());
  const auto bar = text.find('|');
  if (bar == std::string::npos) return Failure{-1, 1, text};
  return Failure{-1, std::atoi(text.substr(0, bar).c_str()), text.substr(bar + 1)};
}

// Starts this node's ranks and supervises them to the end: fail fast, as in the header.
LaunchResult run_attempt(const LaunchOptions& o, Attempt& at) {
  const pid_t self = getpid();
  std::vector<Rank> ranks(o.nproc);
  for (int i = 0; i < o.nproc; ++i) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0)
      throw std::runtime_error("fsdpp launch: pipe failed");
    ranks[i].global_rank = o.node_rank * o.nproc + i;
    ranks[i].error_file = fmt::format("{}/rank{}.{}", at.error_dir, ranks[i].global_rank, at.number);
    ranks[i].pid =
        spawn(at.program, o.command, rank_env(o, at.addr, at.port, i, ranks[i].error_file, at.number), out[1],
              err[1], self);
    close(out[1]);
    close(err[1]);
    ranks[i].fds[0] = out[0];
    ranks[i].fds[1] = err[0];
  }

  LaunchResult result;
  bool stopping = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  auto stop_all = [&](int sig) {
    for (auto& r : ranks)
      if (r.running) killpg(r.pid, sig);
  };
  auto begin_stop = [&] {
    if (stopping) return;
    stopping = true;
    stop_all(SIGTERM);
    deadline = std::chrono::steady_clock::now() + o.stop_grace;
  };

  std::optional<Failure> primary, collateral;
  auto settle_until = std::chrono::steady_clock::time_point::max();
  auto next_store_poll = std::chrono::steady_clock::time_point::min();
  // A failure on another node, published through the store (with several nodes and restarts).
  auto failure_elsewhere = [&] { return published_failure(at.store.get(), at.number); };
  // The attempt's failure; one of this node's is published for the other nodes.
  auto take = [&](const Failure& f) {
    result.failed_rank = f.rank;
    result.exit_code = f.exit_code;
    result.reason = f.reason;
    if (at.store && f.rank >= 0) {
      const auto text = fmt::format("{}|{} (on node {})", f.exit_code, f.reason, o.node_rank);
      try {
        at.store->set(failure_key(at.number), std::vector<uint8_t>(text.begin(), text.end()));
      } catch (const std::exception&) {
        // Node 0 is gone; its launcher has ended the job already.
      }
    }
  };
  int running = o.nproc;
  auto pipes_open = [&] {
    for (auto& r : ranks)
      if (r.fds[0] >= 0 || r.fds[1] >= 0) return true;
    return false;
  };
  auto all_done_at = std::chrono::steady_clock::time_point::max();
  while (running > 0 || pipes_open()) {
    // Helpers that a rank left behind could hold its pipes open; don't wait for them forever.
    if (running == 0 && std::chrono::steady_clock::now() > all_done_at) break;
    std::vector<pollfd> pfds;
    std::vector<std::pair<int, int>> owners;  // (rank index, stream)
    pfds.push_back({g_signal_pipe[0], POLLIN, 0});
    owners.emplace_back(-1, -1);
    for (int i = 0; i < o.nproc; ++i)
      for (int s = 0; s < 2; ++s)
        if (ranks[i].fds[s] >= 0) {
          pfds.push_back({ranks[i].fds[s], POLLIN, 0});
          owners.emplace_back(i, s);
        }
    poll(pfds.data(), pfds.size(), 50);
    for (size_t k = 0; k < pfds.size(); ++k) {
      if (!(pfds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[65536];
      const ssize_t n = read(pfds[k].fd, buf, sizeof(buf));
      if (owners[k].first < 0) continue;  // signal pipe: handled below
      Rank& r = ranks[owners[k].first];
      const int s = owners[k].second;
      if (n > 0) {
        forward(r, s, buf, n, o.prefix_output, false);
      } else if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        forward(r, s, "", 0, o.prefix_output, true);
        close(r.fds[s]);
        r.fds[s] = -1;
      }
    }

    if (const int sig = g_signal.exchange(0)) {
      if (stopping) {
        stop_all(SIGKILL);  // a second Ctrl-C: no more grace
      } else {
        write_all(STDERR_FILENO, fmt::format("fsdpp launch: got {}, stopping all ranks\n", signal_name(sig)));
        if (result.failed_rank < 0) {
          result.exit_code = 128 + sig;
          result.reason = fmt::format("interrupted by {}", signal_name(sig));
        }
        at.interrupted = true;
        begin_stop();
      }
    }

    for (auto& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      if (waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      --running;
      killpg(r.pid, SIGKILL);  // anything the rank left behind in its group
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (ok || stopping) continue;  // ranks stopped by us are not the cause
      Failure f = describe_exit(r, status);
      if (WIFEXITED(status) && WEXITSTATUS(status) == kWatchdogExitCode) {
        f.reason += ": its watchdog ended it, a collective having made no progress";
        f.reason += stopped_ranks(ranks);
      }
      if (!lost_a_peer(r)) {
        if (!primary) primary = f;
      } else if (!collateral) {
        // Give the rank it lost a moment to exit and be named instead.
        collateral = f;
        settle_until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      }
    }
    if (!primary && collateral && std::chrono::steady_clock::now() > settle_until) primary = collateral;
    if (!primary && !stopping && at.store && std::chrono::steady_clock::now() > next_store_poll) {
      primary = failure_elsewhere();
      next_store_poll = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    }
    if (primary && !stopping) {
      take(*primary);
      write_all(STDERR_FILENO, fmt::format("fsdpp launch: {}; stopping the other ranks\n", result.reason));
      begin_stop();
    }
    if (running == 0 && all_done_at == std::chrono::steady_clock::time_point::max())
      all_done_at = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    if (stopping && std::chrono::steady_clock::now() > deadline) {
      stop_all(SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
  }
  for (auto& r : ranks)
    for (int s = 0; s < 2; ++s)
      if (r.fds[s] >= 0) close(r.fds[s]);
  // Every rank here ended, and the only failures were of ranks that lost a peer: the peer may be
  // on another node, whose launcher names it; otherwise the first of them is the failure.
  if (!primary && collateral && !at.interrupted) {
    while (!(primary = failure_elsewhere()) && std::chrono::steady_clock::now() < settle_until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    take(primary ? *primary : *collateral);
    write_all(STDERR_FILENO, fmt::format("fsdpp launch: {}\n", result.reason));
  }
  return result;
}

}  // namespace

LaunchResult launch(const LaunchOptions& o) {
  if (o.nproc < 1) throw std::invalid_argument("fsdpp launch: --nproc must be at least 1");
  if (o.nnodes < 1) throw std::invalid_argument("fsdpp launch: --nnodes must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw std::invalid_argument(
        fmt::format("fsdpp launch: --node-rank {} is outside [0, {})", o.node_rank, o.nnodes));
  if (o.max_restarts < 0) throw std::invalid_argument("fsdpp launch: --max-restarts must be at least 0");
  if (o.command.empty()) throw std::invalid_argument("fsdpp launch: no program given after --");
  if (o.share_gpu && o.nnodes > 1)
    throw std::invalid_argument(
        "fsdpp launch: --share-gpu is for ranks of one node sharing its GPUs; it takes --nnodes 1");
  for (const auto& kv : o.env)
    if (kv.find('=') == std::string::npos || kv.front() == '=')
      throw std::invalid_argument(fmt::format("fsdpp launch: environment entry '{}' is not NAME=value", kv));
  if (o.nnodes > 1 && (o.master_addr.empty() || o.master_port == 0))
    throw std::invalid_argument(
        "fsdpp launch: with --nnodes > 1, give --master-addr and --master-port (the address and "
        "port of node 0, the same on every node)");
  Attempt at;
  at.program = resolve_program(o.command[0]);
  at.addr = o.master_addr.empty() ? "127.0.0.1" : o.master_addr;

  // Node 0's launcher hosts the rendezvous store for the whole job, so it outlives any rank (and
  // any restart). With several nodes and restarts, the other launchers join it too.
  std::shared_ptr<Store> store;
  at.port = o.master_port;
  if (o.node_rank == 0) {
    TcpStoreOptions so;
    so.host = at.addr;
    so.port = o.master_port;
    so.is_server = true;
    store = make_tcp_store(so);
    at.port = tcp_store_port(*store);
  } else if (o.max_restarts > 0) {
    TcpStoreOptions so;
    so.host = at.addr;
    so.port = o.master_port;
    store = make_tcp_store(so);
  }
  if (o.nnodes > 1 && o.max_restarts > 0) at.store = store;

  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error("fsdpp launch: pipe failed");
  g_signal.store(0);
  struct sigaction sa {
  }, old_int{}, old_term{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);

  char dir_template[] = "/tmp/fsdpp-launch-XXXXXX";
  at.error_dir = mkdtemp(dir_template) ? dir_template : "";
  if (at.error_dir.empty()) throw std::runtime_error("fsdpp launch: cannot create a directory in /tmp");

  LaunchResult result;
  for (;; ++at.number) {
    if (at.store && at.number > 0) {
      // Every node's launcher starts the next attempt together (the ranks' rendezvous would wait
      // for the others anyway; this keeps a slow node from being taken for a failed one).
      const auto key = fmt::format("fsdpp/launch/{}/nodes", at.number);
      at.store->add(key, 1);
      while (at.store->add(key, 0) < o.nnodes && !g_signal.load())
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    result = run_attempt(o, at);
    result.restarts = at.number;
    if (at.store && result.exit_code == 0) {
      // Node 0's launcher hosts the store: it stays until every node's ranks are done, so that no
      // node loses the store while its ranks finish (or fail, and restart the job).
      const auto key = fmt::format("fsdpp/launch/{}/done", at.number);
      try {
        at.store->add(key, 1);
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (o.node_rank == 0 && at.store->add(key, 0) < o.nnodes &&
               !at.store->check({failure_key(at.number)}) && std::chrono::steady_clock::now() < give_up &&
               !g_signal.load())
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (const auto f = published_failure(at.store.get(),
                                             at.number)) {  // this node's ranks were done, another's failed
          result.exit_code = f->exit_code;
          result.reason = f->reason;
        }
      } catch (const std::exception&) {
        // Node 0 ended first: the job is over.
      }
    }
    if (result.exit_code == 0 || at.interrupted) break;
    if (at.number >= o.max_restarts) {
      if (o.max_restarts > 0)
        write_all(STDERR_FILENO,
                  fmt::format("fsdpp launch: giving up after {} restart{}; the last failure: {}\n",
                              o.max_restarts, o.max_restarts == 1 ? "" : "s", result.reason));
      break;
    }
    write_all(STDERR_FILENO,
              fmt::format("fsdpp launch: restart {} of {}: starting every rank again (the run resumes "
                          "from its latest checkpoint) after: {}\n",
                          at.number + 1, o.max_restarts, result.reason));
  }

  std::filesystem::remove_all(at.error_dir);
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  close(g_signal_pipe[0]);
  close(g_signal_pipe[1]);
  return result;
}

}  // namespace fsdpp::comm
