// kvxfer native layout transform: KV moves between two paged layouts (NHD, HND, head
// slices, different block sizes) in one call.
//
// A call is a list of segments that share one geometry. Segment i copies, for every token t
// in [0, tokens[i]) and head h in [0, heads), `unit_bytes` bytes from
//   src_addr[i] + t * src_token_stride + h * src_head_stride
// to the same expression on the destination end. One segment is typically one layer's K or V
// plane for a run of tokens that lies inside one source block and one destination block.
//
// As in rowcopy.h, every function reports failure by returning a non-empty message and never
// throws across the C boundary; the CUDA entries are declared here without CUDA headers so
// that the bindings compile as plain C++.
#pragma once

#include <cstdint>
#include <string>

namespace kvxfer {

struct TransformPlan {
  const std::int64_t* src_addr = nullptr;  // n_segments absolute byte addresses (host array)
  const std::int64_t* dst_addr = nullptr;
  const std::int64_t* tokens = nullptr;    // n_segments token counts, >= 0
  std::int64_t n_segments = 0;
  std::int64_t heads = 1;
  std::int64_t unit_bytes = 0;  // bytes of one (token, head): head_dim * element size
  std::int64_t src_token_stride = 0;
  std::int64_t src_head_stride = 0;
  std::int64_t dst_token_stride = 0;
  std::int64_t dst_head_stride = 0;
};

// What one pass over a plan's segments finds. Without an error: `width` is the widest vector
// width (16, 8, 4 or 1 bytes) that every moving segment's addresses, every stride that is
// used and unit_bytes are aligned to; `moving` counts the segments with tokens.
struct TransformScan {
  std::string error;  // check_transform's refusal
  int width = 1;
  std::int64_t moving = 0;
  std::int64_t max_tokens = 0;
  std::int64_t total_tokens = 0;
};
TransformScan scan_transform(const TransformPlan& plan);
// scan_transform that also copies the segments to `out` (unless null) as it reads them: all
// src_addr, then all dst_addr, then all tokens (3 * n_segments words), whatever the verdict;
// a large call's pass is shared with up to threads - 1 helper threads (FillHelpers).
TransformScan scan_transform_into(const TransformPlan& plan, std::int64_t* out, int threads);

// Validates the geometry and every segment (non-negative tokens, non-null addresses where
// anything moves, no address past int64, destination units of one segment not overlapping
// along a dimension). Empty string when fine.
std::string check_transform(const TransformPlan& plan);

// Host memory: memcpy per unit, per run of units, or per segment where the units are
// contiguous on both ends; split across up to `threads` threads (0 = choose from the size
// and the machine) when the copy is large. Checks the plan first.
std::string host_transform(const TransformPlan& plan, int threads);

namespace cuda {

// One kernel launch on `stream` of `device` (-1: the current device). The plan's arrays are
// host arrays, read before this returns: up to 1280 segments (128 before CUDA 12.1) travel
// in the launch parameters, more through pinned staging uploaded on a stream of its own that
// the kernel waits for. Returns once the work is queued.
std::string transform_copy(const TransformPlan& plan, int device, std::uint64_t stream);

// transform_copy, then on the same stream the 8-byte doorbell store of bell_value at bell_ptr
// (0: none) and the record of `event` (0: none), as cuda::copy_rows_then does for rows. The
// returned message is the copy's failure (then nothing was queued); failures of the store or
// of the record, queued after the copy, go to *bell_err / *event_err.
std::string transform_copy_then(const TransformPlan& plan, int device, std::uint64_t stream, std::uint64_t bell_ptr,
                                std::uint64_t bell_value, std::uint64_t event, std::string* bell_err,
                                std::string* event_err);

}  // namespace cuda
}  // namespace kvxfer
