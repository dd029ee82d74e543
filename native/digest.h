// kvxfer native row digest (kvxfer.backends.common.integrity defines it): for each row,
// its bytes zero-padded to m little-endian uint64 words x_0 .. x_{m-1}, and, modulo 2**64,
//   D = A + K * B,  A = sum_i x_i,  B = sum_i (m - i) * x_i   (a += x; b += a per word).
// Rows are read where they lie (base + slots[i] * stride), scattered or not: no gather copy.
#pragma once

#include <cstdint>
#include <string>

namespace kvxfer {

// out[i] = D of the row_bytes bytes at base + slots[i] * stride (slots null: row i is slot i),
// for i < n, with the constant k. Rows split across up to `threads` threads (0 = choose from
// the size and the machine) when there are many bytes. Empty string when done; else why not
// (nothing written then).
std::string host_row_digests(std::uint64_t base, std::int64_t stride, const std::int64_t* slots, std::int64_t n,
                             std::int64_t row_bytes, std::uint64_t k, std::uint64_t* out, int threads);

// Engine geometries (kvxfer.backends.common.plan_digest): a row of the destination is not one
// span but units (one token's head, unit_bytes) placed in it in a canonical order, and each
// segment here is a run of such units read where they lie (addr[s] + t * token_stride +
// h * head_stride, t < tokens[s], h < heads) that land in one row at byte
// offset[s] + t * canon_token + h * canon_head of that row's row_bytes[s] bytes. out[s] is the
// segment's share of that row's digest: the digest is linear, so a row's digest is the sum
// (mod 2**64) of its segments' shares, with no row assembled. Units off 8-byte boundaries in
// the row are summed byte by byte (slower, same value).
struct SegmentDigests {
  const std::int64_t* addr = nullptr;
  const std::int64_t* tokens = nullptr;
  const std::int64_t* offset = nullptr;
  const std::int64_t* row_bytes = nullptr;
  std::int64_t n_segments = 0;
  std::int64_t heads = 1;
  std::int64_t unit_bytes = 0;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
  std::int64_t canon_token = 0;
  std::int64_t canon_head = 0;
  std::uint64_t k = 0;
};
std::string host_segment_digests(const SegmentDigests& plan, std::uint64_t* out, int threads);

}  // namespace kvxfer
