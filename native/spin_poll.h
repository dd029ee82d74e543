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

// One pause between two looks at memory or the clock in a spin loop: it yields the core's
// execution resources to its hyperthread sibling (on a VM, often the owner thread of another
// process: a publisher whose kernel this spinner waits for) and cuts the power a tight loop
// draws, for tens of nanoseconds of added reaction time.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls `fds` for input without blocking, again and again, for up to `timeout_us`:
// *ready = true once any has input, an error or a hang-up, or once any of the `n` 8-byte
// words `words[slots[i]]` is non-zero (doorbells a GPU writes into shared host memory; see
// kvxfer/backends/ipc/doorbells.py). Empty string, or errno's text.
inline std::string spin_poll(const std::vector<int>& fds, std::int64_t timeout_us, const volatile std::uint64_t* words,
                             const std::int64_t* slots, std::size_t n, bool* ready) {
  *ready = false;
  std::vector<pollfd> set(fds.size());
  for (std::size_t i = 0; i < fds.size(); ++i) set[i] = pollfd{fds[i], POLLIN, 0};
  const auto start = std::chrono::steady_clock::now();
  const auto end = start + std::chrono::microseconds(timeout_us);
  // With words to watch, poll(2) (about a microsecond, more on a virtual machine) runs every
  // few microseconds and the words are read in between (nanoseconds each); without, it runs
  // back to back.
  const auto poll_every = std::chrono::microseconds(n ? 4 : 0);
  auto next_poll = start;
  for (;;) {
    for (std::size_t i = 0; i < n; ++i) {
      if (words[slots[i]] != 0) {
        *ready = true;
        return {};
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_poll) {
      int k = ::poll(set.data(), set.size(), 0);
      if (k > 0) {
        *ready = true;
        return {};
      }
      if (k < 0 && errno != EINTR) return std::string("poll: ") + std::strerror(errno);
      next_poll = now + poll_every;
    }
    if (now >= end) return {};
    cpu_relax();
  }
}

}  // namespace kvxfer
