// kvxfer's integrity digest (kvxfer/backends/common/integrity.py) of rows in device memory, for
// the movers whose bytes do not pass through a kvxfer kernel (NIXL, UCX): the publisher's digest
// of the rows it sends, and the fetcher's check of the rows where they landed. The IPC copy
// kernel takes the same digest fused in its copy (cuda_rowcopy.cu); this is a pass of its own.
//
// D = sum_i (1 + k * (m - i)) * x_i mod 2**64 over a row's m little-endian 8-byte words (the
// last zero-padded). D is linear in the row's bytes, so each thread weighs the words it reads
// and the sums of a row meet by atomics, in any order.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_api.h"
#include "cuda_common.cuh"

namespace kvxfer::cuda {
namespace {

using common::DeviceScope;
using common::fail;

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long word_weight(unsigned long long k, long long words, long long word) {
  return 1ull + k * static_cast<unsigned long long>(words - word);
}

// Blocks along x split a row into spans; along y, rows (grid-stride). `wide`: every row starts
// on a 16-byte boundary and is a whole number of 16-byte vectors.
__global__ void __launch_bounds__(kThreads) digest_kernel(const unsigned char* base, long long stride,
                                                          const long long* slots, long long rows, long long row_bytes,
                                                          unsigned long long k, bool wide,
                                                          unsigned long long* out) {
  const long long words = (row_bytes + 7) / 8;
  for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
    const unsigned char* r = base + slots[row] * stride;
    unsigned long long sum = 0;
    if (wide) {
      const long long vectors = row_bytes / 16;
      for (long long v = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; v < vectors;
           v += static_cast<long long>(gridDim.x) * blockDim.x) {
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(r) + v);
        const unsigned long long w = word_weight(k, words, 2 * v);
        sum += w * ((static_cast<unsigned long long>(x.y) << 32) | x.x) +
               (w - k) * ((static_cast<unsigned long long>(x.w) << 32) | x.z);
      }
    } else {
      for (long long b = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; b < row_bytes;
           b += static_cast<long long>(gridDim.x) * blockDim.x) {
        sum += word_weight(k, words, b >> 3) * (static_cast<unsigned long long>(r[b]) << (8 * (b & 7)));
      }
    }
    for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
    if ((threadIdx.x & 31) == 0 && sum != 0) atomicAdd(out + row, sum);
  }
}

}  // namespace

std::string row_digests(int device, std::uint64_t stream, std::uint64_t base, std::int64_t stride,
                        const std::int64_t* slots, std::int64_t rows, std::int64_t row_bytes, std::uint64_t k,
                        std::uint64_t* out) {
  if (rows <= 0) return {};
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("cudaSetDevice", scope.error());
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const std::size_t slot_bytes = static_cast<std::size_t>(rows) * sizeof(long long);
  const std::size_t sum_bytes = static_cast<std::size_t>(rows) * sizeof(unsigned long long);
  void* scratch = nullptr;
  cudaError_t err = cudaMallocAsync(&scratch, slot_bytes + sum_bytes, s);
  if (err != cudaSuccess) return fail("cudaMallocAsync (digest scratch)", err);
  auto* dev_slots = static_cast<long long*>(scratch);
  auto* dev_sums = reinterpret_cast<unsigned long long*>(static_cast<char*>(scratch) + slot_bytes);
  std::string message;
  if ((err = cudaMemcpyAsync(dev_slots, slots, slot_bytes, cudaMemcpyHostToDevice, s)) != cudaSuccess) {
    message = fail("cudaMemcpyAsync (digest slots)", err);
  } else if ((err = cudaMemsetAsync(dev_sums, 0, sum_bytes, s)) != cudaSuccess) {
    message = fail("cudaMemsetAsync (digest sums)", err);
  } else {
    const bool wide = base % 16 == 0 && stride % 16 == 0 && row_bytes % 16 == 0;
    const long long per_row = wide ? row_bytes / 16 : row_bytes;
    long long spans = (per_row + kThreads * 4 - 1) / (kThreads * 4);  // about 4 vectors a thread
    if (spans > 1024) spans = 1024;
    if (spans < 1) spans = 1;
    const long long ys = rows < 65535 ? rows : 65535;
    dim3 grid(static_cast<unsigned>(spans), static_cast<unsigned>(ys));
    digest_kernel<<<grid, kThreads, 0, s>>>(reinterpret_cast<const unsigned char*>(base), stride, dev_slots, rows,
                                             row_bytes, k, wide, dev_sums);
    if ((err = cudaGetLastError()) != cudaSuccess) {
      message = fail("digest kernel launch", err);
    } else if ((err = cudaMemcpyAsync(out, dev_sums, sum_bytes, cudaMemcpyDeviceToHost, s)) != cudaSuccess) {
      message = fail("cudaMemcpyAsync (digests)", err);
    }
  }
  cudaError_t freed = cudaFreeAsync(scratch, s);
  cudaError_t synced = cudaStreamSynchronize(s);
  if (message.empty() && freed != cudaSuccess) message = fail("cudaFreeAsync (digest scratch)", freed);
  if (message.empty() && synced != cudaSuccess) message = fail("cudaStreamSynchronize (digests)", synced);
  return message;
}

}  // namespace kvxfer::cuda
