// Stress test of FillHelpers (native/fill_helpers.h), built and run by
// tests/test_native_fill_helpers.py: every lent task runs on exactly the helpers it was
// lent to, join() waits for all of them, concurrent callers never share the helpers, and
// stop() joins every thread (restarting on the next lend).
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "fill_helpers.h"

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "FAILED line %d: %s\n", __LINE__, #cond);  \
      return 1;                                                       \
    }                                                                 \
  } while (0)

int main() {
  auto& h = kvxfer::FillHelpers::instance();
  CHECK(h.threads() == 0);
  for (int round = 0; round < 2000; ++round) {
    std::atomic<int> ran{0};
    std::size_t want = 1 + round % 3;
    {
      kvxfer::FillHelpers::Lease lease(h);
      std::size_t lent = lease.lend([&] { ran.fetch_add(1); }, want);
      CHECK(lent == want);
      lease.join();
      CHECK(ran.load() == static_cast<int>(want));
    }
    if (round % 500 == 499) {
      h.stop();
      CHECK(h.threads() == 0);
    }
  }
  // Concurrent callers: one holds the helpers, the others fill alone (lend returns 0).
  std::atomic<int> lent_total{0}, ran_total{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        kvxfer::FillHelpers::Lease lease(h);
        std::atomic<int> ran{0};
        const std::size_t lent = lease.lend([&] { ran.fetch_add(1); }, 3);
        lease.join();
        if (static_cast<int>(lent) != ran.load()) std::abort();
        lent_total += static_cast<int>(lent);
        ran_total += ran.load();
      }
    });
  }
  for (auto& c : callers) c.join();
  CHECK(lent_total.load() == ran_total.load());
  CHECK(lent_total.load() > 0);
  h.stop();
  CHECK(h.threads() == 0);
  std::printf("ok\n");
  return 0;
}
