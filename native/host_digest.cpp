// Host row digest (digest.h). One pass over each row where it lies, in lanes: the Fletcher
// recurrence a += x; b += a is one serial chain per accumulator, so eight interleaved chains
// (words 8j + l) run in vector registers, and their sums recombine exactly into the row's A
// and B (modulo 2**64, so in any order).
#include <algorithm>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "digest.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the row digest reads words as little-endian uint64: this host is not little-endian"
#endif

namespace kvxfer {
namespace {

constexpr int kLanes = 8;
constexpr std::int64_t kBytesPerThread = 8ll << 20;  // below this a thread costs more than it saves

// Two uint64 lanes (GCC and Clang vector extensions): one SSE2 register, which every x86-64
// has; four of them make the eight chains.
typedef std::uint64_t Lanes2 __attribute__((vector_size(16)));

inline Lanes2 load_lanes(const unsigned char* p) {
  Lanes2 v;
  std::memcpy(&v, p, sizeof v);  // any alignment
  return v;
}

std::uint64_t row_digest(const unsigned char* row, std::int64_t row_bytes, std::uint64_t k) {
  const std::int64_t full = row_bytes / 8;          // whole words
  const std::int64_t m = (row_bytes + 7) / 8;       // words after zero padding
  const std::int64_t blocks = full / kLanes;
  Lanes2 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  const unsigned char* p = row;
  for (std::int64_t j = 0; j < blocks; ++j, p += 8 * kLanes) {
    a0 += load_lanes(p);
    a1 += load_lanes(p + 16);
    a2 += load_lanes(p + 32);
    a3 += load_lanes(p + 48);
    b0 += a0;
    b1 += a1;
    b2 += a2;
    b3 += a3;
  }
  const Lanes2 av[4] = {a0, a1, a2, a3}, bv[4] = {b0, b1, b2, b3};
  std::uint64_t a[kLanes], b[kLanes];
  std::memcpy(a, av, sizeof a);
  std::memcpy(b, bv, sizeof b);
  // Word i = 8j + l of the blocks has weight m - i = r + 8 (J - j) - l, r = m - 8J; lane l's
  // b holds sum_j (J - j) x, its a sum_j x.
  const std::uint64_t r = static_cast<std::uint64_t>(m - kLanes * blocks);
  std::uint64_t A = 0, B = 0;
  for (int l = 0; l < kLanes; ++l) {
    A += a[l];
    B += static_cast<std::uint64_t>(kLanes) * b[l] - static_cast<std::uint64_t>(l) * a[l];
  }
  B += r * A;
  // The tail: the words left after the blocks, the last one zero-padded.
  std::uint64_t ta = 0, tb = 0;
  for (std::int64_t i = kLanes * blocks; i < m; ++i, p += 8) {
    std::uint64_t x = 0;
    std::memcpy(&x, p, static_cast<std::size_t>(std::min<std::int64_t>(8, row_bytes - 8 * i)));
    ta += x;
    tb += ta;
  }
  A += ta;
  B += tb;
  return A + k * B;
}

void digest_range(std::uint64_t base, std::int64_t stride, const std::int64_t* slots, std::int64_t row_bytes,
                  std::uint64_t k, std::uint64_t* out, std::int64_t begin, std::int64_t end) {
  auto* at = reinterpret_cast<const unsigned char*>(base);
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t s = slots ? slots[i] : i;
    out[i] = row_digest(at + s * stride, row_bytes, k);
  }
}

}  // namespace

std::string host_row_digests(std::uint64_t base, std::int64_t stride, const std::int64_t* slots, std::int64_t n,
                             std::int64_t row_bytes, std::uint64_t k, std::uint64_t* out, int threads) {
  if (n < 0) return "n is negative";
  if (row_bytes < 0 || stride < 0) return "row_bytes and stride must not be negative";
  if (n == 0) return {};
  if (row_bytes > 0 && base == 0) return "the base address is null";
  if (slots) {
    for (std::int64_t i = 0; i < n; ++i)
      if (slots[i] < 0) return "slot " + std::to_string(slots[i]) + " at row " + std::to_string(i) + " is negative";
  }
  const std::int64_t total = n * row_bytes;
  std::int64_t want;
  if (threads > 0) {
    want = std::min<std::int64_t>(threads, n);
  } else {
    const std::int64_t hw = std::max(1u, std::thread::hardware_concurrency());
    want = std::max<std::int64_t>(1, std::min<std::int64_t>({total / kBytesPerThread, hw, n, 16}));
  }
  const std::int64_t share = (n + want - 1) / want;
  std::vector<std::thread> pool;
  std::int64_t started = 1;  // shares begun (the first runs here)
  try {
    for (std::int64_t t = 1; t < want && t * share < n; ++t, ++started)
      pool.emplace_back(digest_range, base, stride, slots, row_bytes, k, out, t * share, std::min(n, (t + 1) * share));
  } catch (const std::exception&) {
    // Fewer threads than wanted: the shares none took are done here below.
  }
  digest_range(base, stride, slots, row_bytes, k, out, 0, std::min(share, n));
  for (auto& th : pool) th.join();
  if (started * share < n) digest_range(base, stride, slots, row_bytes, k, out, started * share, n);
  return {};
}

}  // namespace kvxfer
