// Errors of the native core. The binding maps SystemError to OSError (errno, path kept)
// and std::invalid_argument to ValueError; nothing here knows about Python.
#pragma once
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace smartinf {

class SystemError : public std::runtime_error {
 public:
  SystemError(int code, const std::string& what, std::string path)
      : std::runtime_error(what + " (" + path + "): " + std::strerror(code)),
        code_(code),
        message_(what),
        path_(std::move(path)) {}
  int code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  const std::string& path() const noexcept { return path_; }

 private:
  int code_;
  std::string message_;
  std::string path_;
};

// Throws SystemError for a negative-errno result; returns the result otherwise.
inline long check(long res, const char* what, const std::string& path) {
  if (res < 0) throw SystemError(static_cast<int>(-res), what, path);
  return res;
}

inline long check_errno(long res, const char* what, const std::string& path) {
  if (res < 0) throw SystemError(errno, what, path);
  return res;
}

}  // namespace smartinf
