#include "liveness.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tide::host_detail {
namespace {

struct ProcStat {
  bool ok = false;
  char state = '?';
  uint64_t start_time = 0;
};

ProcStat read_proc_stat(long pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return {};
  char buf[1024];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may contain spaces and ')'
  if (p == nullptr || p[1] != ' ') return {};
  ProcStat s;
  s.state = p[2];
  // After ") ": state is field 3; starttime is field 22. q starts at the blank before field 4.
  const char* q = p + 3;
  for (int field = 4; field < 22 && q != nullptr; ++field) q = std::strchr(q + 1, ' ');
  if (q == nullptr) return {};
  s.start_time = std::strtoull(q + 1, nullptr, 10);
  s.ok = true;
  return s;
}

}  // namespace

HostExecutor::Identity self_identity() {
  HostExecutor::Identity id;
  id.pid = static_cast<uint64_t>(::getpid());
  const ProcStat s = read_proc_stat(::getpid());
  if (s.ok) id.start_time = s.start_time;
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) == 0) id.pid_ns = st.st_ino;
  return id;
}

bool process_exited(const HostExecutor::Identity& self, uint64_t pid, uint64_t start_time,
                    uint64_t pid_ns) {
  if (pid == 0 || pid == self.pid || self.pid_ns == 0 || pid_ns != self.pid_ns) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  const ProcStat s = read_proc_stat(static_cast<long>(pid));
  if (!s.ok) return false;  // hidden (/proc hidepid) or just exited: the next check decides
  if (s.state == 'Z' || s.state == 'X') return true;
  return start_time != 0 && s.start_time != start_time;
}

}  // namespace tide::host_detail
