// Host row copy: runs of rows contiguous on both ends become one memcpy; a large copy is cut
// into equal shares of rows, each on its own thread, because one core's memcpy bandwidth is
// well below what host memory gives to several.
#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "rowcopy.h"

namespace kvxfer {
namespace {

constexpr std::int64_t kBytesPerThread = 4ll << 20;  // below this a thread costs more than it saves

inline std::int64_t slot_of(const Space& s, std::int64_t i) { return s.index ? s.index[i] : i; }

void copy_range(const CopyPlan& p, std::int64_t begin, std::int64_t end) {
  auto* src = reinterpret_cast<const unsigned char*>(p.src.base);
  auto* dst = reinterpret_cast<unsigned char*>(p.dst.base);
  // Coalescing is only valid when a row fills its slot on both ends.
  const bool dense = p.row_bytes == p.src.stride && p.row_bytes == p.dst.stride;
  std::int64_t i = begin;
  while (i < end) {
    const std::int64_t s0 = slot_of(p.src, i);
    const std::int64_t d0 = slot_of(p.dst, i);
    std::int64_t n = 1;
    if (dense) {
      while (i + n < end && slot_of(p.src, i + n) == s0 + n && slot_of(p.dst, i + n) == d0 + n) ++n;
    }
    std::memmove(dst + d0 * p.dst.stride, src + s0 * p.src.stride, static_cast<std::size_t>(n * p.row_bytes));
    i += n;
  }
}

}  // namespace

std::string check_plan(const CopyPlan& p) {
  if (p.n_rows < 0) return "n_rows is negative";
  if (p.row_bytes < 0) return "row_bytes is negative";
  if (p.src.stride < 0 || p.dst.stride < 0) return "a stride is negative";
  if (p.n_rows == 0 || p.row_bytes == 0) return {};
  if (p.src.base == 0 || p.dst.base == 0) return "a base address is null";
  if (p.row_bytes > p.src.stride)
    return "row_bytes " + std::to_string(p.row_bytes) + " exceeds the source stride " + std::to_string(p.src.stride);
  if (p.row_bytes > p.dst.stride)
    return "row_bytes " + std::to_string(p.row_bytes) + " exceeds the destination stride " +
           std::to_string(p.dst.stride);
  return {};
}

std::string check_indices(const std::int64_t* index, std::int64_t n, std::int64_t limit, const char* what) {
  if (limit < 0) return {};
  if (index == nullptr) {  // a contiguous end: rows 0 .. n-1
    if (n > limit)
      return std::string(what) + " rows 0.." + std::to_string(n - 1) + " do not fit its " + std::to_string(limit) +
             " slots";
    return {};
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t v = index[i];
    if (v < 0 || v >= limit)
      return std::string(what) + " index " + std::to_string(v) + " at row " + std::to_string(i) +
             " is outside [0, " + std::to_string(limit) + ")";
  }
  return {};
}

int vector_width(const CopyPlan& p) {
  for (int w : {16, 8, 4}) {
    const bool ok = p.src.base % w == 0 && p.dst.base % w == 0 && p.src.stride % w == 0 && p.dst.stride % w == 0;
    if (ok) return w;
  }
  return 1;
}

std::string host_copy_rows(const CopyPlan& p, int threads) {
  std::string err = check_plan(p);
  if (!err.empty() || p.n_rows == 0 || p.row_bytes == 0) return err;
  const std::int64_t total = p.n_rows * p.row_bytes;
  std::int64_t want;
  if (threads > 0) {
    want = std::min<std::int64_t>(threads, p.n_rows);
  } else {
    const std::int64_t hw = std::max(1u, std::thread::hardware_concurrency());
    want = std::max<std::int64_t>(1, std::min<std::int64_t>({total / kBytesPerThread, hw, p.n_rows, 64}));
  }
  if (want == 1) {
    copy_range(p, 0, p.n_rows);
    return {};
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(want - 1));
  const std::int64_t share = (p.n_rows + want - 1) / want;
  try {
    for (std::int64_t t = 1; t < want; ++t) {
      const std::int64_t b = t * share, e = std::min(p.n_rows, b + share);
      if (b >= e) break;
      pool.emplace_back(copy_range, std::cref(p), b, e);
    }
  } catch (const std::exception& ex) {
    err = std::string("could not start copy threads: ") + ex.what();
  }
  // Whatever threads started must finish before we return: they read the caller's memory.
  copy_range(p, 0, std::min(share, p.n_rows));
  for (auto& th : pool) th.join();
  if (!err.empty()) {
    // The rows of threads that did not start are still to copy; do them here.
    const std::int64_t b = (static_cast<std::int64_t>(pool.size()) + 1) * share;
    if (b < p.n_rows) copy_range(p, b, p.n_rows);
    err.clear();
  }
  return err;
}

}  // namespace kvxfer
