#include "pipeline/host_turns.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "error.h"

namespace smartinf::pipeline {
namespace {

std::string lock_directory() {
  if (::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  const char* tmp = std::getenv("TMPDIR");
  return tmp && *tmp ? tmp : "/tmp";
}

}  // namespace

bool HostTurns::across_host() {
  const char* v = std::getenv("SMARTINF_IO_TURNS");
  const std::string given = v && *v ? v : "host";
  if (given != "host" && given != "process")
    throw std::invalid_argument("SMARTINF_IO_TURNS=" + given + ": expected host or process");
  return given == "host";
}

HostTurns::HostTurns(const std::string& directory, std::atomic<uint64_t>& waits) : waits_(waits) {
  struct stat st;
  if (::stat(directory.c_str(), &st) != 0)
    throw SystemError(errno, "cannot stat the device directory", directory);
  char name[64];
  std::snprintf(name, sizeof name, "/smartinf-io-turns-%llx.lock",
                static_cast<unsigned long long>(st.st_dev));
  path_ = lock_directory() + name;
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd_ < 0) throw SystemError(errno, "cannot open the host's I/O turns lock", path_);
  (void)::fchmod(fd_, 0666);  // (ranks of other users of the host share it; best effort)
}

HostTurns::~HostTurns() {
  if (fd_ >= 0) ::close(fd_);  // (gives the turn back if held)
}

bool HostTurns::try_take() {
  while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return false;
    if (errno != EINTR) throw SystemError(errno, "cannot take the host's I/O turn", path_);
  }
  return true;
}

void HostTurns::take() {
  if (try_take()) return;
  ++waits_;
  while (::flock(fd_, LOCK_EX) != 0)
    if (errno != EINTR) throw SystemError(errno, "cannot take the host's I/O turn", path_);
}

void HostTurns::give_back() {
  (void)::flock(fd_, LOCK_UN);
  sched_yield();  // a process waiting for the turn gets it before this one asks again
}

}  // namespace smartinf::pipeline
