// kvxfer native row copy: one call moves many rows between two "spaces".
//
// A space is (base address, stride in bytes, optional int64 slot index array): row i of the
// call lives at base + index[i] * stride, or at base + i * stride when the index array is
// null (a contiguous buffer). Copy rows between two slot regions, gather slots into a
// contiguous buffer, and scatter a contiguous buffer into slots are all this one operation.
//
// Every function reports failure by returning a non-empty message (CUDA's own error text
// where CUDA failed); nothing here throws across the C boundary or aborts the process.
#pragma once

#include <cstdint>
#include <string>

namespace kvxfer {

struct Space {
  std::uint64_t base = 0;
  std::int64_t stride = 0;            // bytes between consecutive slots
  const std::int64_t* index = nullptr;  // n_rows slot numbers, or null: row i is slot i
};

struct CopyPlan {
  Space src;
  Space dst;
  std::int64_t n_rows = 0;
  std::int64_t row_bytes = 0;  // bytes copied per row (<= both strides)
};

// Validates geometry (non-negative sizes, row_bytes <= strides). Empty string when fine.
std::string check_plan(const CopyPlan& plan);

// Validates that every index lies in [0, limit); with a null index (a contiguous end), that
// its n rows fit the limit. limit < 0 skips the check (the caller checked).
std::string check_indices(const std::int64_t* index, std::int64_t n, std::int64_t limit, const char* what);

// Host memory: memcpy per run of rows contiguous on both ends, split across up to
// `threads` threads (0 = choose from the size and the machine) when the copy is large.
std::string host_copy_rows(const CopyPlan& plan, int threads);

// Widest vector width (16, 8, 4 or 1 bytes) that every row start of the plan is aligned to.
int vector_width(const CopyPlan& plan);

}  // namespace kvxfer
