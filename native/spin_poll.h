// Waiting for file descriptors without sleeping: a latency-critical progress thread polls
// its sockets in a loop instead of blocking in poll(2). A thread woken from a blocking
// poll pays the scheduler's wake-up, tens of microseconds on a virtual machine whose idle
// vCPU was halted; spinning trades one busy core for that. Called with the GIL released.
#pragma once

#include <poll.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvxfer {

// Polls `fds` for input without blocking, again and again, for up to `timeout_us`:
// *ready = true once any has input, an error or a hang-up. Empty string, or errno's text.
inline std::string spin_poll(const std::vector<int>& fds, std::int64_t timeout_us, bool* ready) {
  *ready = false;
  std::vector<pollfd> set(fds.size());
  for (std::size_t i = 0; i < fds.size(); ++i) set[i] = pollfd{fds[i], POLLIN, 0};
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  for (;;) {
    int n = ::poll(set.data(), set.size(), 0);
    if (n > 0) {
      *ready = true;
      return {};
    }
    if (n < 0 && errno != EINTR) return std::string("poll: ") + std::strerror(errno);
    if (std::chrono::steady_clock::now() >= end) return {};
  }
}

}  // namespace kvxfer
