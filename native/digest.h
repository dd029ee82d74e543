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

}  // namespace kvxfer
