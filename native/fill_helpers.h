// Persistent helper threads for filling index staging (see pipelined_copy): starting three
// threads per large submission cost tens of microseconds on a VM before the first chunk was
// filled. The helpers start on first use, sleep on a condition variable between tasks, are
// lent to one caller at a time (a caller that finds them lent fills alone), and stop when
// stop() is called (kvxfer.native calls it at interpreter exit) or with the process. The
// instance is never destroyed: a destructor run by exit() could wait for a caller that a
// daemon thread left inside a copy.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvxfer {

class FillHelpers {
 public:
  static FillHelpers& instance() {
    static FillHelpers* helpers = new FillHelpers();
    return *helpers;
  }

  // Runs `task` on up to `want` helpers while the caller works too; lend() returns how many
  // took it (0 when the helpers are lent to another caller). The caller must call join()
  // before anything `task` uses goes away; the Lease does that on every path.
  class Lease {
   public:
    explicit Lease(FillHelpers& h) : h_(h), held_(h.in_use_.try_lock()) {}
    ~Lease() {
      if (!held_) return;
      join();
      h_.in_use_.unlock();
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    std::size_t lend(std::function<void()> task, std::size_t want) {
      if (!held_ || want == 0) return 0;
      std::lock_guard<std::mutex> lock(h_.mu_);
      while (h_.threads_.size() < want) {
        try {
          // Started with the generation before this task's, so that it takes this task too.
          h_.threads_.emplace_back([h = &h_, seen = h_.generation_] { h->loop(seen); });
        } catch (...) {
          break;  // fewer helpers: the caller fills the rest
        }
      }
      const std::size_t n = std::min(want, h_.threads_.size());
      h_.task_ = std::move(task);
      h_.wanted_ = n;
      h_.running_ = n;
      ++h_.generation_;
      h_.wake_.notify_all();
      lent_ = n > 0;
      return n;
    }

    void join() {
      if (!lent_) return;
      std::unique_lock<std::mutex> lock(h_.mu_);
      h_.idle_.wait(lock, [this] { return h_.running_ == 0; });
      h_.task_ = nullptr;
      lent_ = false;
    }

   private:
    FillHelpers& h_;
    bool held_;
    bool lent_ = false;
  };

  // Joins the helpers (after the current lease, if any, ends); the next lend starts them again.
  void stop() {
    std::lock_guard<std::mutex> lent(in_use_);
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      wake_.notify_all();
      threads.swap(threads_);
    }
    for (auto& t : threads) t.join();
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = false;
  }

  std::size_t threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_.size();
  }

 private:
  FillHelpers() = default;

  void loop(std::uint64_t seen) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      // Only the first `wanted_` helpers to wake take the task; the others sleep again.
      if (taken_generation_ != seen) {
        taken_generation_ = seen;
        taken_ = 0;
      }
      if (taken_++ >= wanted_) continue;
      std::function<void()> task = task_;
      lock.unlock();
      task();
      lock.lock();
      if (--running_ == 0) idle_.notify_all();
    }
  }

  std::mutex in_use_;  // held by the caller the helpers are lent to
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::vector<std::thread> threads_;
  std::function<void()> task_;
  std::uint64_t generation_ = 0;
  std::uint64_t taken_generation_ = 0;
  std::size_t taken_ = 0;
  std::size_t wanted_ = 0;
  std::size_t running_ = 0;
  bool stopping_ = false;
};

}  // namespace kvxfer
