#include "fault.h"

#include <csignal>
#include <mutex>
#include <stdexcept>

#include "error.h"

namespace smartinf::fault {
namespace {

std::mutex mu;
std::string armed_point;
Action armed_action = Action::none;
uint64_t countdown = 0;
int code = 5;  // EIO

}  // namespace

std::atomic<bool> armed{false};

Action hit(const char* point) {
  std::lock_guard lock(mu);
  if (!armed.load() || armed_point != point) return Action::none;
  if (countdown > 0) {
    --countdown;
    return Action::none;
  }
  const Action action = armed_action;
  if (action == Action::kill) std::raise(SIGKILL);
  armed = false;  // one fault per arm
  return action;
}

void arm(const std::string& point, Action action, uint64_t after, int error_code) {
  static const char* const known[] = {"io.read", "io.write", "store.synced", "manifest.written",
                                      "manifest.renamed", "pipeline.device_committed",
                                      "log.written", "log.sealed", "journal.synced"};
  bool ok = false;
  for (const char* k : known) ok = ok || point == k;
  if (!ok) throw std::invalid_argument("unknown fault point '" + point + "'");
  std::lock_guard lock(mu);
  armed_point = point;
  armed_action = action;
  countdown = after;
  code = error_code;
  armed = action != Action::none;
}

void disarm() {
  std::lock_guard lock(mu);
  armed = false;
}

int error_code() {
  std::lock_guard lock(mu);
  return code;
}

void check(const char* point, const std::string& path) {
  if (at(point) == Action::error) throw SystemError(error_code(), std::string("injected fault at ") + point, path);
}

}  // namespace smartinf::fault
