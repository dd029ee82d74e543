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
// *ready = true once any has input, an error or a hang-up, or once any of the `n` 8-byte
// words `words[slots[i]]` is non-zero (doorbells a GPU writes into shared host memory; see
// kvxfer/backends/ipc_bells.py). Empty string, or errno's text.
inline std::string spin_poll(const std::vector<int>& fds, std::int64_t timeout_us, const volatile std::uint64_t* words,
                             const std::int64_t* slots, std::size_t n, bool* ready) {
  *ready = false;
  std::vector<pollfd> set(fds.size());
  for (std::size_t i = 0; i < fds.size(); ++i) set[i] = pollfd{fds[i], POLLIN, 0};
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  for (;;) {
    // The words first and several times per poll(2): reading them costs nanoseconds, a
    // poll system call about a microsecond.
    for (int round = 0; round < 8; ++round) {
      for (std::size_t i = 0; i < n; ++i) {
        if (words[slots[i]] != 0) {
          *ready = true;
          return {};
        }
      }
    }
    int k = ::poll(set.data(), set.size(), 0);
    if (k > 0) {
      *ready = true;
      return {};
    }
    if (k < 0 && errno != EINTR) return std::string("poll: ") + std::strerror(errno);
    if (std::chrono::steady_clock::now() >= end) return {};
  }
}

}  // namespace kvxfer
