// Host row digest (digest.h). One pass over each row where it lies, in lanes: the Fletcher
// recurrence a += x; b += a is one serial chain per accumulator, so eight interleaved chains
// (words 8j + l) run in vector registers, and their sums recombine exactly into the row's A
// and B (modulo 2**64, so in any order).
#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
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

struct Sums {
  std::uint64_t a, b;  // A = sum_i x_i, B = sum_i (m - i) x_i
};

Sums row_sums(const unsigned char* row, std::int64_t row_bytes) {
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
  return {A, B};
}

std::uint64_t row_digest(const unsigned char* row, std::int64_t row_bytes, std::uint64_t k) {
  const Sums s = row_sums(row, row_bytes);
  return s.a + k * s.b;
}

// One unit's share of its row's digest, the unit landing at byte q of a row of m words. At a
// word boundary with whole words (w of them, o = q / 8): its words y_j are the row's words
// o + j, of weight 1 + k (m - o - j), so the share is A + k (B + (m - o - w) A) with the
// unit's own sums. Else byte by byte: byte b of the unit is bits 8 ((q + b) % 8) of word
// (q + b) / 8, and the digest is linear in every word.
std::uint64_t unit_share(const unsigned char* unit, std::int64_t unit_bytes, std::int64_t q, std::int64_t m,
                         std::uint64_t k) {
  if (q % 8 == 0 && unit_bytes % 8 == 0) {
    const Sums s = row_sums(unit, unit_bytes);
    const auto rest = static_cast<std::uint64_t>(m - q / 8 - unit_bytes / 8);
    return s.a + k * (s.b + rest * s.a);
  }
  std::uint64_t out = 0;
  for (std::int64_t b = 0; b < unit_bytes; ++b) {
    const std::int64_t at = q + b;
    const std::uint64_t weight = 1 + k * static_cast<std::uint64_t>(m - at / 8);
    out += weight * (static_cast<std::uint64_t>(unit[b]) << (8 * (at % 8)));
  }
  return out;
}

void segment_range(const SegmentDigests& p, std::uint64_t* out, std::int64_t begin, std::int64_t end) {
  // Units adjacent both where they lie and in the row are one span: a token's heads when
  // they are contiguous in memory (the row's heads always are), and then a segment's tokens
  // when those are too. Fewer, longer spans run at the row digest's speed.
  std::int64_t span = p.unit_bytes, heads = p.heads;
  if (heads == 1 || (p.head_stride == p.unit_bytes && p.canon_head == p.unit_bytes)) {
    span *= heads;
    heads = 1;
  }
  const bool tokens_join = heads == 1 && p.token_stride == span && p.canon_token == span;
  for (std::int64_t s = begin; s < end; ++s) {
    const std::int64_t m = (p.row_bytes[s] + 7) / 8;
    const auto* at = reinterpret_cast<const unsigned char*>(p.addr[s]);
    if (tokens_join) {
      out[s] = p.tokens[s] > 0 ? unit_share(at, span * p.tokens[s], p.offset[s], m, p.k) : 0;
      continue;
    }
    std::uint64_t sum = 0;
    for (std::int64_t t = 0; t < p.tokens[s]; ++t) {
      for (std::int64_t h = 0; h < heads; ++h)
        sum += unit_share(at + t * p.token_stride + h * p.head_stride, span,
                          p.offset[s] + t * p.canon_token + h * p.canon_head, m, p.k);
    }
    out[s] = sum;
  }
}

std::string check_segments(const SegmentDigests& p) {
  if (p.n_segments < 0) return "n_segments is negative";
  if (p.heads < 1 || p.unit_bytes < 1) return "heads and unit_bytes must be at least 1";
  if (p.token_stride < 0 || p.head_stride < 0 || p.canon_token < 0 || p.canon_head < 0)
    return "strides must not be negative";
  for (std::int64_t s = 0; s < p.n_segments; ++s) {
    if (p.tokens[s] < 0) return "tokens[" + std::to_string(s) + "] is negative";
    if (p.tokens[s] == 0) continue;
    if (p.addr[s] <= 0) return "addr[" + std::to_string(s) + "] is not an address";
    const std::int64_t last = p.offset[s] + (p.tokens[s] - 1) * p.canon_token + (p.heads - 1) * p.canon_head;
    if (p.offset[s] < 0 || last + p.unit_bytes > p.row_bytes[s])
      return "segment " + std::to_string(s) + " lands at bytes [" + std::to_string(p.offset[s]) + ", " +
             std::to_string(last + p.unit_bytes) + ") of a row of " + std::to_string(p.row_bytes[s]);
  }
  return {};
}

void digest_range(std::uint64_t base, std::int64_t stride, const std::int64_t* slots, std::int64_t row_bytes,
                  std::uint64_t k, std::uint64_t* out, std::int64_t begin, std::int64_t end) {
  auto* at = reinterpret_cast<const unsigned char*>(base);
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t s = slots ? slots[i] : i;
    out[i] = row_digest(at + s * stride, row_bytes, k);
  }
}

// Runs range(begin, end) over [0, n) in contiguous shares, one a thread: `threads` of them when
// positive, else as many as `total` bytes pay for (kBytesPerThread each, at most 16 and the cores).
template <typename Range>
void split_ranges(std::int64_t n, std::int64_t total, int threads, const Range& range) {
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
      pool.emplace_back(range, t * share, std::min(n, (t + 1) * share));
  } catch (const std::exception&) {
    // Fewer threads than wanted: the shares none took are done here below.
  }
  range(0, std::min(share, n));
  for (auto& th : pool) th.join();
  if (started * share < n) range(started * share, n);
}

}  // namespace

std::string host_segment_digests(const SegmentDigests& p, std::uint64_t* out, int threads) {
  std::string err = check_segments(p);
  if (!err.empty() || p.n_segments == 0) return err;
  const std::int64_t n = p.n_segments;
  std::int64_t units = 0;
  for (std::int64_t s = 0; s < n; ++s) units += p.tokens[s];
  const std::int64_t total = units * p.heads * p.unit_bytes;
  split_ranges(n, total, threads,
               [&p, out](std::int64_t begin, std::int64_t end) { segment_range(p, out, begin, end); });
  return {};
}

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
  split_ranges(n, n * row_bytes, threads, [=](std::int64_t begin, std::int64_t end) {
    digest_range(base, stride, slots, row_bytes, k, out, begin, end);
  });
  return {};
}

}  // namespace kvxfer
