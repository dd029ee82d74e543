// One-launch batched row copy on the GPU, and the small set of runtime calls the IPC backend
// needs (streams, events, IPC handles). The grid is flattened over (row, chunk) items and
// uses vector loads of the widest width (16, 8, 4 or 1 bytes) that every row start is
// aligned to; any row size is correct (see rowcopy_kernel for the tail).
#include <cuda.h>
#include <cuda_runtime.h>

#include <sys/socket.h>
#include <unistd.h>
#include <cerrno>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <cstdint>
#include <mutex>
#include <vector>
#include <unordered_map>
#include <utility>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda_api.h"
#include "cuda_common.cuh"
#include "fill_helpers.h"
#include "spin_poll.h"

namespace kvxfer::cuda {
namespace {

using common::DeviceScope;
using common::Vec;
using common::fail;

constexpr int kThreads = 256;
constexpr int kInlineRows = 64;    // 2 x 64 x 8 B of indices ride in the launch parameters
constexpr std::int64_t kMaxGrid = 1ll << 20;

// Selects `device` for the rest of the enclosing function, which returns the error text when
// it cannot be selected (every entry point below starts so).
#define KVXFER_DEVICE_SCOPE(device)                                  \
  DeviceScope device_scope_(device);                                 \
  if (device_scope_.error() != cudaSuccess) return fail("selecting the device", device_scope_.error())

struct Indices {
  const std::int64_t* src;  // null: row i is slot i
  const std::int64_t* dst;
};

struct InlineIndices {
  std::int64_t src[kInlineRows];
  std::int64_t dst[kInlineRows];
  bool has_src;
  bool has_dst;
};

struct Geometry {
  const unsigned char* src;
  unsigned char* dst;
  std::int64_t src_stride;
  std::int64_t dst_stride;
  std::int64_t n_rows;
  std::int64_t row_bytes;
  std::int64_t body_bytes;      // row_bytes rounded down to the vector width
  std::int64_t chunk_bytes;     // kThreads * W
  std::int64_t chunks_per_row;
};

// A doorbell rung by the copy kernel itself: the last block to finish stores `value` at `bell`
// (page-locked host memory a waiting peer polls). `counter` is a word of device memory owned
// by the stream (zero between kernels): each block counts itself done there, after a system
// fence over its own stores, and the last one resets it and stores the value. bell == null:
// no doorbell. Used for small copies, whose one launch is then the whole submission.
struct Signal {
  unsigned long long* bell;
  unsigned long long value;
  unsigned int* counter;
};

__device__ __forceinline__ void ring_if_last(const Signal& sig) {
  if (sig.bell == nullptr) return;
  __threadfence_system();  // this thread's row stores, before the block counts as done
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(sig.counter, 1u) == gridDim.x - 1) {
    *sig.counter = 0;  // for the stream's next kernel, which starts after this one ends
    __threadfence_system();
    *reinterpret_cast<volatile unsigned long long*>(sig.bell) = sig.value;
  }
}

// The row check (kvxfer's integrity digest, kvxfer/backends/common/integrity.py): each row's
// digest D = sum_i (1 + k * (m - i)) * x_i mod 2**64 over its m little-endian 8-byte words
// (zero-padded), taken over the bytes the kernel read and again over the bytes it reads back
// from where it wrote them (a volatile load: the write's line, from L2 when it is still there).
// D is linear in the row's bytes, so each thread weighs the vector it read and the vector it
// reads back: a row's two digests differ exactly when the weights of some vector of it do
// (weights are odd, so a vector's weight changes with any change confined to one word), and
// the thread holding such a vector counts it in `acc` by an atomic. A clean copy makes no
// atomic at all: summing every vector's weight into a row's total, as the other movers'
// digests do, cost the large rows most of their throughput in contended atomics. The launch's
// last block writes one byte per row to `out` (host memory mapped for the device: 0 every
// vector the same, 1 not) and zeroes `acc` for the stream's next launch. out == null: no check.
struct Check {
  unsigned char* out;        // one byte per row of the whole copy (row_base + launch row)
  unsigned long long* acc;   // 2 per row of this launch: 0, vectors that differ (zero between launches)
  unsigned int* counter;     // blocks of this launch done (zero between launches)
  unsigned long long k;
  long long words;           // m: the row's 8-byte words, the last one zero-padded
  long long row_base;        // this launch's first row within the copy
  bool corrupt;              // test hook: rows whose out byte reads kCorruptRow lose one bit (see below)
};
constexpr unsigned char kCorruptRow = 0xFE;

__device__ __forceinline__ unsigned long long weight(const Check& c, long long word) {
  return 1ull + c.k * static_cast<unsigned long long>(c.words - word);
}
// The weighted sum of one vector of a row at byte offset `off` (a whole word, two, or part of one:
// a part contributes its bytes shifted to their place in the word, which is what the word is).
__device__ __forceinline__ unsigned long long weigh(const uint4& v, long long off, const Check& c) {
  const unsigned long long w = weight(c, off >> 3);
  const unsigned long long x0 = (static_cast<unsigned long long>(v.y) << 32) | v.x;
  const unsigned long long x1 = (static_cast<unsigned long long>(v.w) << 32) | v.z;
  return w * x0 + (w - c.k) * x1;  // the next word's weight is k less
}
__device__ __forceinline__ unsigned long long weigh(const uint2& v, long long off, const Check& c) {
  return weight(c, off >> 3) * ((static_cast<unsigned long long>(v.y) << 32) | v.x);
}
__device__ __forceinline__ unsigned long long weigh(unsigned int v, long long off, const Check& c) {
  return weight(c, off >> 3) * (static_cast<unsigned long long>(v) << (8 * (off & 7)));
}
__device__ __forceinline__ unsigned long long weigh(unsigned char v, long long off, const Check& c) {
  return weight(c, off >> 3) * (static_cast<unsigned long long>(v) << (8 * (off & 7)));
}

// After a block stored its U items: read each back, weigh it, and count a vector whose two
// weights differ against its row.
template <int W, int U>
__device__ __forceinline__ void check_items(const Geometry& g, const Check& c, std::int64_t first,
                                            std::int64_t items, unsigned char* const (&dst)[U],
                                            const unsigned long long (&read)[U]) {
  using V = typename Vec<W>::T;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const std::int64_t item = first + u;
    if (item >= items) break;
    const std::int64_t row = item / g.chunks_per_row;
    const std::int64_t chunk = item - row * g.chunks_per_row;
    unsigned long long landed = 0;
    if (dst[u] != nullptr) {
      if (c.corrupt && chunk == 0 && threadIdx.x == 0 &&
          *reinterpret_cast<volatile unsigned char*>(c.out + c.row_base + row) == kCorruptRow) {
        // Fault injection: damage the row where it landed, after its store and before the check.
        *reinterpret_cast<volatile unsigned char*>(dst[u]) ^= 1u;
      }
      landed = weigh(__ldcv(reinterpret_cast<const V*>(dst[u])), chunk * g.chunk_bytes + threadIdx.x * W, c);
    }
    // A vector that landed as it was read weighs the same both times: the sums of a clean row
    // never meet, so no atomic (contended by every block of a large row) costs a clean copy.
    // A vector whose weights differ marks its row (a row's two digests differ when any does).
    if (read[u] != landed) atomicAdd(c.acc + 2 * row + 1, 1ull);
  }
}

// The launch's last block: compare, report, reset; and ring the doorbell only if every row of
// the launch checked out (a doorbell says DELIVERED, every row).
__device__ void finish_check(const Geometry& g, const Check& c, const Signal& sig) {
  __shared__ bool last;
  __shared__ unsigned int differ;
  __threadfence();  // this block's sums, before it counts itself done
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(c.counter, 1u) == gridDim.x - 1;
    differ = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  unsigned int mine = 0;
  for (std::int64_t r = threadIdx.x; r < g.n_rows; r += blockDim.x) {
    const unsigned long long a = atomicExch(c.acc + 2 * r, 0ull);
    const unsigned long long b = atomicExch(c.acc + 2 * r + 1, 0ull);
    c.out[c.row_base + r] = a != b ? 1 : 0;
    mine += a != b ? 1u : 0u;
  }
  if (mine != 0) atomicAdd(&differ, mine);
  __threadfence_system();  // the out bytes, before a doorbell says the copy ended
  __syncthreads();
  if (threadIdx.x != 0) return;
  *c.counter = 0;
  if (sig.bell != nullptr && differ == 0) {
    __threadfence_system();
    *reinterpret_cast<volatile unsigned long long*>(sig.bell) = sig.value;
  }
}

__device__ __forceinline__ std::int64_t src_slot(const Indices& ix, std::int64_t r) {
  return ix.src ? __ldg(ix.src + r) : r;
}
__device__ __forceinline__ std::int64_t dst_slot(const Indices& ix, std::int64_t r) {
  return ix.dst ? __ldg(ix.dst + r) : r;
}
__device__ __forceinline__ std::int64_t src_slot(const InlineIndices& ix, std::int64_t r) {
  return ix.has_src ? ix.src[r] : r;
}
__device__ __forceinline__ std::int64_t dst_slot(const InlineIndices& ix, std::int64_t r) {
  return ix.has_dst ? ix.dst[r] : r;
}

// Items are (row, chunk) pairs with chunks of kThreads vectors; a block takes U consecutive
// items and each thread issues its U loads before any store, so that small rows (one chunk
// each) still keep U loads per thread in flight. The bytes of a row past its last whole
// vector (the tail) are copied bytewise by the block holding the row's last chunk.
template <int W, int U, typename Ix, bool C>
__global__ void __launch_bounds__(kThreads) rowcopy_kernel(Geometry g, Ix ix, Signal sig, Check c) {
  using V = typename Vec<W>::T;
  const std::int64_t items = g.n_rows * g.chunks_per_row;
  for (std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * U; first < items;
       first += static_cast<std::int64_t>(gridDim.x) * U) {
    V tmp[U];
    unsigned char* dst[U];
    unsigned long long read[U];  // C: each item's weighted sum of what this thread read
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dst[u] = nullptr;
      read[u] = 0;
      const std::int64_t item = first + u;
      if (item < items) {
        const std::int64_t row = item / g.chunks_per_row;
        const std::int64_t off = (item - row * g.chunks_per_row) * g.chunk_bytes + static_cast<std::int64_t>(threadIdx.x) * W;
        if (off < g.body_bytes) {
          tmp[u] = *reinterpret_cast<const V*>(g.src + src_slot(ix, row) * g.src_stride + off);
          dst[u] = g.dst + dst_slot(ix, row) * g.dst_stride + off;
          if constexpr (C) read[u] = weigh(tmp[u], off, c);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (dst[u] != nullptr) *reinterpret_cast<V*>(dst[u]) = tmp[u];
    }
    if constexpr (C) check_items<W, U>(g, c, first, items, dst, read);
    if (g.body_bytes == g.row_bytes) continue;
    for (int u = 0; u < U; ++u) {
      const std::int64_t item = first + u;
      if (item >= items) break;
      const std::int64_t row = item / g.chunks_per_row;
      if (item - row * g.chunks_per_row != g.chunks_per_row - 1) continue;
      const unsigned char* s = g.src + src_slot(ix, row) * g.src_stride;
      unsigned char* d = g.dst + dst_slot(ix, row) * g.dst_stride;
      for (std::int64_t b = g.body_bytes + threadIdx.x; b < g.row_bytes; b += kThreads) {
        const unsigned char v = s[b];
        d[b] = v;
        if constexpr (C) {
          if (weigh(v, b, c) != weigh(__ldcv(d + b), b, c)) atomicAdd(c.acc + 2 * row + 1, 1ull);
        }
      }
    }
  }
  if constexpr (C) {
    finish_check(g, c, sig);
  } else {
    ring_if_last(sig);
  }
}

int unroll_setting() {
  // KVXFER_ROWCOPY_UNROLL=8 trades blocks for loads in flight; read once, for tuning runs.
  static const int value = [] {
    const char* env = std::getenv("KVXFER_ROWCOPY_UNROLL");
    return (env != nullptr && std::atoi(env) == 8) ? 8 : 4;
  }();
  return value;
}

template <int U, typename Ix, bool C>
cudaError_t launch_uc(int width, const Geometry& g, const Ix& ix, cudaStream_t stream, std::int64_t items,
                      const Signal& sig, const Check& c) {
  const std::int64_t grid = std::min<std::int64_t>((items + U - 1) / U, kMaxGrid);
  const dim3 blocks(static_cast<unsigned>(grid)), threads(kThreads);
  switch (width) {
    case 16: rowcopy_kernel<16, U, Ix, C><<<blocks, threads, 0, stream>>>(g, ix, sig, c); break;
    case 8: rowcopy_kernel<8, U, Ix, C><<<blocks, threads, 0, stream>>>(g, ix, sig, c); break;
    case 4: rowcopy_kernel<4, U, Ix, C><<<blocks, threads, 0, stream>>>(g, ix, sig, c); break;
    default: rowcopy_kernel<1, U, Ix, C><<<blocks, threads, 0, stream>>>(g, ix, sig, c); break;
  }
  return cudaGetLastError();
}

template <int U, typename Ix>
cudaError_t launch_u(int width, const Geometry& g, const Ix& ix, cudaStream_t stream, std::int64_t items,
                     const Signal& sig, const Check& c) {
  return c.out != nullptr ? launch_uc<U, Ix, true>(width, g, ix, stream, items, sig, c)
                          : launch_uc<U, Ix, false>(width, g, ix, stream, items, sig, c);
}

template <typename Ix>
cudaError_t launch(int width, const Geometry& g, const Ix& ix, cudaStream_t stream, const Signal& sig = Signal{},
                   const Check& c = Check{}) {
  const std::int64_t items = g.n_rows * g.chunks_per_row;
  return unroll_setting() == 8 ? launch_u<8>(width, g, ix, stream, items, sig, c)
                               : launch_u<4>(width, g, ix, stream, items, sig, c);
}

// The block counter of Signal, one per (device, stream), made on first use and freed with
// the stream. Keyed by device too: stream 0 is each device's own default stream, and a
// counter must live on the device whose kernels count into it.
std::mutex g_counters_mu;
std::map<std::pair<int, std::uint64_t>, unsigned int*> g_counters;

std::string stream_counter(int device, std::uint64_t stream, unsigned int** out) {
  KVXFER_DEVICE_SCOPE(device);
  int current = -1;
  cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess) return fail("reading the current device", e);
  std::lock_guard<std::mutex> lock(g_counters_mu);
  const auto key = std::make_pair(current, stream);
  auto it = g_counters.find(key);
  if (it != g_counters.end()) {
    *out = it->second;
    return {};
  }
  unsigned int* counter = nullptr;
  e = cudaMalloc(&counter, sizeof(unsigned int));
  if (e != cudaSuccess) return fail("allocating a doorbell block counter", e);
  // On the copy stream itself: a plain cudaMemset goes to the legacy stream, which a
  // non-blocking stream's kernels do not wait for.
  e = cudaMemsetAsync(counter, 0, sizeof(unsigned int), reinterpret_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    (void)cudaFree(counter);
    return fail("clearing a doorbell block counter", e);
  }
  g_counters.emplace(key, counter);
  *out = counter;
  return {};
}

// The row check's device words of one (device, stream): its block counter and its per-row
// sums, grown on demand (the launches of one stream run one after the other, and each one's
// last block zeroes what it used).
struct CheckWords {
  unsigned int* counter = nullptr;
  unsigned long long* acc = nullptr;
  std::int64_t rows = 0;  // acc holds 2 per row
};
std::map<std::pair<int, std::uint64_t>, CheckWords> g_check_words;  // under g_counters_mu

std::string check_words(int device, std::uint64_t stream, std::int64_t rows, CheckWords* out) {
  KVXFER_DEVICE_SCOPE(device);
  int current = -1;
  cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess) return fail("reading the current device", e);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  std::lock_guard<std::mutex> lock(g_counters_mu);
  CheckWords& w = g_check_words[std::make_pair(current, stream)];
  if (w.counter == nullptr) {
    e = cudaMalloc(&w.counter, sizeof(unsigned int));
    if (e == cudaSuccess) e = cudaMemsetAsync(w.counter, 0, sizeof(unsigned int), s);
    if (e != cudaSuccess) {
      (void)cudaFree(w.counter);
      w.counter = nullptr;
      return fail("allocating the row check's block counter", e);
    }
  }
  if (w.rows < rows) {
    // Kernels queued before may still add into the old sums: let them end first.
    e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) return fail("waiting for the stream before growing the row check's sums", e);
    (void)cudaFree(w.acc);
    w.acc = nullptr;
    w.rows = 0;
    std::int64_t cap = 8192;
    while (cap < rows) cap <<= 1;
    const std::size_t bytes = sizeof(unsigned long long) * 2 * static_cast<std::size_t>(cap);
    e = cudaMalloc(&w.acc, bytes);
    if (e == cudaSuccess) e = cudaMemsetAsync(w.acc, 0, bytes, s);
    if (e != cudaSuccess) {
      (void)cudaFree(w.acc);
      w.acc = nullptr;
      return fail("allocating the row check's sums", e);
    }
    w.rows = cap;
  }
  *out = w;
  return {};
}

// A created stream's handle is unique across devices, so its counters go with it whatever
// the device; the default streams' counters live as long as the process.
void drop_stream_counter(std::uint64_t stream) {
  std::lock_guard<std::mutex> lock(g_counters_mu);
  for (auto it = g_counters.begin(); it != g_counters.end();) {
    if (it->first.second == stream) {
      (void)cudaFree(it->second);
      it = g_counters.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = g_check_words.begin(); it != g_check_words.end();) {
    if (it->first.second == stream) {
      (void)cudaFree(it->second.counter);
      (void)cudaFree(it->second.acc);
      it = g_check_words.erase(it);
    } else {
      ++it;
    }
  }
}

// Index staging: a pinned host buffer and a device buffer of the same size. A pageable
// cudaMemcpyAsync is staged by the driver at a few GB/s, and stream-ordered allocations are
// returned to the system at every synchronization (the default pool keeps nothing), both of
// which cost more than copying 4 KiB rows. A slot is reused once the event recorded after the
// kernel that read its indices has completed; slots live as long as the process (a handful,
// grown on demand).
struct Staging {
  void* host = nullptr;
  void* dev = nullptr;
  std::size_t cap = 0;
  cudaEvent_t done = nullptr;
  int device = -1;
  bool busy = false;
  // Large submissions upload their indices in chunks on a stream of their own, so that the
  // copy engine moves chunk k+1's indices while the kernel of chunk k runs (see copy_rows).
  cudaStream_t upload = nullptr;
  std::vector<cudaEvent_t> ready;  // one per chunk: that chunk's indices are on the device
};
std::mutex g_staging_mu;
std::vector<Staging*> g_staging;
constexpr std::size_t kMaxStaging = 16;

std::string take_staging(int device, std::size_t bytes, Staging** out) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  Staging* victim = nullptr;
  for (Staging* st : g_staging) {
    if (st->busy || st->device != device) continue;
    if (cudaEventQuery(st->done) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (st->cap >= bytes) {
      st->busy = true;
      *out = st;
      return {};
    }
    victim = st;  // idle but too small: grow it
  }
  if (victim == nullptr && g_staging.size() >= kMaxStaging) {
    for (Staging* st : g_staging) {  // all in flight: wait for one of this device
      if (st->busy || st->device != device) continue;
      cudaError_t e = cudaEventSynchronize(st->done);
      if (e != cudaSuccess) return fail("waiting for index staging", e);
      victim = st;
      break;
    }
    if (victim == nullptr) return "no index staging buffer is free";
  }
  std::size_t cap = 1 << 16;
  while (cap < bytes) cap <<= 1;
  void* host = nullptr;
  void* dev = nullptr;
  cudaError_t e = cudaHostAlloc(&host, cap, cudaHostAllocPortable);
  if (e != cudaSuccess) return fail("allocating pinned index staging", e);
  e = cudaMalloc(&dev, cap);
  if (e != cudaSuccess) {
    (void)cudaFreeHost(host);
    return fail("allocating device index staging", e);
  }
  if (victim == nullptr) {
    victim = new Staging();
    victim->device = device;
    e = cudaEventCreateWithFlags(&victim->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      (void)cudaFreeHost(host);
      (void)cudaFree(dev);
      delete victim;
      return fail("creating a staging event", e);
    }
    e = cudaStreamCreateWithFlags(&victim->upload, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      (void)cudaFreeHost(host);
      (void)cudaFree(dev);
      (void)cudaEventDestroy(victim->done);
      delete victim;
      return fail("creating an index upload stream", e);
    }
    g_staging.push_back(victim);
  } else {
    // Its last kernel has completed (event checked above): nothing reads these any more.
    (void)cudaFreeHost(victim->host);
    (void)cudaFree(victim->dev);
  }
  victim->host = host;
  victim->dev = dev;
  victim->cap = cap;
  victim->busy = true;
  *out = victim;
  return {};
}

// Events marking chunks' indices as uploaded; grown on demand, reused once `done` completed.
std::string ready_events(Staging* st, std::size_t n) {
  while (st->ready.size() < n) {
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) return fail("creating an index upload event", e);
    st->ready.push_back(ev);
  }
  return {};
}

void give_staging(Staging* st, cudaStream_t stream, bool recorded_ok) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  if (!recorded_ok || cudaEventRecord(st->done, stream) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaStreamSynchronize(stream);  // cannot track it: make sure the upload is over
    (void)cudaGetLastError();
  }
  st->busy = false;
}

constexpr std::int64_t kPipelineRows = 8192;
constexpr std::size_t kMaxChunks = 8;
constexpr std::size_t kFillHelpers = 3;  // threads that fill index staging beside the caller

// The first chunk is kPipelineRows rows, so that the first kernel starts after a short fill
// and upload; the rest is split in up to kMaxChunks - 1 chunks of at least kPipelineRows
// (each chunk costs a launch, an upload and an event on the host). Filling the pinned staging
// (16 bytes per row) is a host memcpy that one core of a VM does at a few GB/s, slower than
// the kernel copies 4 KiB rows; persistent helpers (FillHelpers) fill chunks ahead while the
// caller queues each chunk, in order, as soon as it is filled.
std::vector<std::int64_t> chunk_starts(std::int64_t n_rows) {
  std::vector<std::int64_t> starts{0};
  const std::int64_t rest = n_rows - kPipelineRows;
  if (rest > 0) {
    const std::int64_t chunk = std::max<std::int64_t>(
        kPipelineRows, (rest + static_cast<std::int64_t>(kMaxChunks) - 2) / static_cast<std::int64_t>(kMaxChunks - 1));
    for (std::int64_t at = kPipelineRows; at < n_rows; at += chunk) starts.push_back(at);
  }
  starts.push_back(n_rows);  // the end of the last chunk
  return starts;
}

std::string pipelined_copy(const CopyPlan& p, const Geometry& g, int width, int arrays, Staging* st,
                           cudaStream_t stream, const Check& check) {
  const std::vector<std::int64_t> starts = chunk_starts(p.n_rows);
  const std::size_t chunks = starts.size() - 1;
  std::string err = ready_events(st, chunks);
  if (!err.empty()) return err;
  auto* host = static_cast<unsigned char*>(st->host);
  auto* dev = static_cast<unsigned char*>(st->dev);
  auto rows_of = [&](std::size_t c) { return starts[c + 1] - starts[c]; };
  auto offset_of = [&](std::size_t c) {
    return sizeof(std::int64_t) * static_cast<std::size_t>(starts[c]) * static_cast<std::size_t>(arrays);
  };
  std::unique_ptr<std::atomic<bool>[]> filled(new std::atomic<bool>[chunks]);
  for (std::size_t c = 0; c < chunks; ++c) filled[c].store(false, std::memory_order_relaxed);
  std::atomic<std::size_t> next{0};
  auto fill_one = [&]() {
    const std::size_t c = next.fetch_add(1, std::memory_order_relaxed);
    if (c >= chunks) return false;
    const std::int64_t first = starts[c];
    const std::size_t one = sizeof(std::int64_t) * static_cast<std::size_t>(rows_of(c));
    unsigned char* h = host + offset_of(c);
    if (p.src.index) std::memcpy(h, p.src.index + first, one);
    if (p.dst.index) std::memcpy(h + (p.src.index ? one : 0), p.dst.index + first, one);
    filled[c].store(true, std::memory_order_release);
    return true;
  };
  // Declared after what the task uses: whatever happens below (an error, an exception), the
  // helpers stop claiming chunks and are joined before those go away (they read the caller's
  // index arrays too).
  FillHelpers::Lease helpers(FillHelpers::instance());
  struct StopClaims {
    std::atomic<std::size_t>& next;
    std::size_t chunks;
    ~StopClaims() { next.store(chunks, std::memory_order_relaxed); }
  };
  StopClaims stop_claims{next, chunks};  // destroyed first: then the lease joins
  helpers.lend([&] { while (fill_one()) {} }, std::min<std::size_t>(kFillHelpers, chunks - 1));
  for (std::size_t c = 0; c < chunks && err.empty(); ++c) {
    while (!filled[c].load(std::memory_order_acquire)) {
      if (!fill_one()) std::this_thread::yield();  // help, or wait for the helper filling chunk c
    }
    const std::int64_t first = starts[c];
    const std::int64_t rows = rows_of(c);
    const std::size_t one = sizeof(std::int64_t) * static_cast<std::size_t>(rows);
    const std::size_t at = offset_of(c);
    cudaError_t e = cudaMemcpyAsync(dev + at, host + at, one * arrays, cudaMemcpyHostToDevice, st->upload);
    if (e == cudaSuccess) e = cudaEventRecord(st->ready[c], st->upload);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, st->ready[c], 0);
    if (e != cudaSuccess) {
      err = fail("uploading row indices", e);
      break;
    }
    Geometry gc = g;
    gc.n_rows = rows;
    gc.src = g.src + (p.src.index ? 0 : first * g.src_stride);  // a contiguous end moves on by rows
    gc.dst = g.dst + (p.dst.index ? 0 : first * g.dst_stride);
    const auto* cursor = reinterpret_cast<const std::int64_t*>(dev + at);
    Indices ix{p.src.index ? cursor : nullptr, p.dst.index ? cursor + (p.src.index ? rows : 0) : nullptr};
    Check cc = check;
    cc.row_base = first;  // this chunk's rows report at their place in the copy
    e = launch(width, gc, ix, stream, Signal{}, cc);
    if (e != cudaSuccess) err = fail("launching the row copy kernel", e);
  }
  if (!err.empty()) {
    // An upload may be queued whose event the copy stream never waited on: finish it, so that
    // nothing writes this staging slot after it is handed back.
    (void)cudaStreamSynchronize(st->upload);
    (void)cudaGetLastError();
  }
  return err;
}

}  // namespace

namespace {
std::string copy_rows_signal(const CopyPlan& p, bool indices_on_device, int device, std::uint64_t stream_handle,
                             const Signal* sig, bool* rang, const RowCheck* check);
}  // namespace

std::string copy_rows(const CopyPlan& p, bool indices_on_device, int device, std::uint64_t stream_handle,
                      const RowCheck* check) {
  bool rang = false;
  return copy_rows_signal(p, indices_on_device, device, stream_handle, nullptr, &rang, check);
}

namespace {
// copy_rows; with `sig`, a small copy (indices in the launch parameters) rings the doorbell
// from its own kernel and *rang is set (with a check, only if every row checked out); other
// copies leave it to the caller.
std::string copy_rows_signal(const CopyPlan& p, bool indices_on_device, int device, std::uint64_t stream_handle,
                             const Signal* sig, bool* rang, const RowCheck* check) {
  *rang = false;
  std::string err = check_plan(p);
  if (!err.empty() || p.n_rows == 0 || p.row_bytes == 0) return err;
  KVXFER_DEVICE_SCOPE(device);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  Check c{};
  if (check != nullptr && check->out != 0) {
    CheckWords words;
    err = check_words(device, stream_handle, p.n_rows, &words);
    if (!err.empty()) return err;
    c.out = reinterpret_cast<unsigned char*>(check->out);
    c.acc = words.acc;
    c.counter = words.counter;
    c.k = check->k;
    c.words = (p.row_bytes + 7) / 8;
    c.row_base = 0;
    c.corrupt = check->corrupt;
  }

  const int width = vector_width(p);
  Geometry g{};
  g.src = reinterpret_cast<const unsigned char*>(p.src.base);
  g.dst = reinterpret_cast<unsigned char*>(p.dst.base);
  g.src_stride = p.src.stride;
  g.dst_stride = p.dst.stride;
  g.n_rows = p.n_rows;
  g.row_bytes = p.row_bytes;
  g.body_bytes = p.row_bytes - p.row_bytes % width;
  g.chunk_bytes = static_cast<std::int64_t>(kThreads) * width;
  g.chunks_per_row = std::max<std::int64_t>(1, (g.body_bytes + g.chunk_bytes - 1) / g.chunk_bytes);

  if (indices_on_device) {
    cudaError_t e = launch(width, g, Indices{p.src.index, p.dst.index}, stream, Signal{}, c);
    return e == cudaSuccess ? std::string() : fail("launching the row copy kernel", e);
  }
  if (p.src.index == nullptr && p.dst.index == nullptr) {
    // Contiguous on both ends: nothing to upload.
    cudaError_t e = launch(width, g, Indices{nullptr, nullptr}, stream, Signal{}, c);
    return e == cudaSuccess ? std::string() : fail("launching the row copy kernel", e);
  }
  if (p.n_rows <= kInlineRows) {
    // Small submissions (the latency case) skip the index upload entirely.
    InlineIndices ix{};
    ix.has_src = p.src.index != nullptr;
    ix.has_dst = p.dst.index != nullptr;
    if (ix.has_src) std::memcpy(ix.src, p.src.index, sizeof(std::int64_t) * p.n_rows);
    if (ix.has_dst) std::memcpy(ix.dst, p.dst.index, sizeof(std::int64_t) * p.n_rows);
    cudaError_t e = launch(width, g, ix, stream, sig != nullptr ? *sig : Signal{}, c);
    *rang = e == cudaSuccess && sig != nullptr;
    return e == cudaSuccess ? std::string() : fail("launching the row copy kernel", e);
  }
  // Pinned host and device staging (see Staging): fill, upload, launch, then an event marks
  // the slot reusable once the kernel that reads it has finished. The call never waits.
  // Past kPipelineRows rows the work goes in chunks: filling chunk k+1's staging on the host
  // (a memcpy of 16 bytes per row) overlaps its upload and the kernel of chunk k, instead of
  // the whole index upload preceding the first row copied.
  const int arrays = (p.src.index ? 1 : 0) + (p.dst.index ? 1 : 0);
  const std::size_t one = sizeof(std::int64_t) * static_cast<std::size_t>(p.n_rows);
  int current = device;
  if (current < 0) {
    cudaError_t e = cudaGetDevice(&current);
    if (e != cudaSuccess) return fail("cudaGetDevice", e);
  }
  Staging* st = nullptr;
  err = take_staging(current, one * arrays, &st);
  if (!err.empty()) return err;
  struct GiveBack {  // the slot is handed back on every path, exceptions included
    Staging* st;
    cudaStream_t stream;
    ~GiveBack() { give_staging(st, stream, true); }
  } give_back{st, stream};
  if (p.n_rows > kPipelineRows) return pipelined_copy(p, g, width, arrays, st, stream, c);
  auto* host = static_cast<unsigned char*>(st->host);
  if (p.src.index) std::memcpy(host, p.src.index, one);
  if (p.dst.index) std::memcpy(host + (p.src.index ? one : 0), p.dst.index, one);
  cudaError_t e = cudaMemcpyAsync(st->dev, host, one * arrays, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) {
    Indices ix{nullptr, nullptr};
    auto* cursor = static_cast<const std::int64_t*>(st->dev);
    if (p.src.index) ix.src = cursor;
    if (p.dst.index) ix.dst = cursor + (p.src.index ? p.n_rows : 0);
    e = launch(width, g, ix, stream, Signal{}, c);
    if (e != cudaSuccess) err = fail("launching the row copy kernel", e);
  } else {
    err = fail("uploading row indices", e);
  }
  return err;
}

}  // namespace

std::string versions(int* runtime, int* driver) {
  *runtime = 0;
  *driver = 0;
  cudaError_t e = cudaRuntimeGetVersion(runtime);
  if (e != cudaSuccess) return fail("cudaRuntimeGetVersion", e);
  e = cudaDriverGetVersion(driver);
  return e == cudaSuccess ? std::string() : fail("cudaDriverGetVersion", e);
}

std::string device_count(int* count) {
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(count);
  return e == cudaSuccess ? std::string() : fail("cudaGetDeviceCount", e);
}

// Lets kernels on `device` read and write `peer`'s memory in this process (a CUDA IPC
// mapping enables it lazily by itself; plain allocations of another device need this).
std::string peer_access(int device, int peer, bool* enabled) {
  *enabled = false;
  int can = 0;
  cudaError_t e = cudaDeviceCanAccessPeer(&can, device, peer);
  if (e != cudaSuccess) return fail("cudaDeviceCanAccessPeer", e);
  if (!can) return std::string();
  KVXFER_DEVICE_SCOPE(device);
  e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    e = cudaSuccess;
  }
  *enabled = e == cudaSuccess;
  return e == cudaSuccess ? std::string() : fail("cudaDeviceEnablePeerAccess", e);
}

std::string stream_create(int device, std::uint64_t* out) {
  KVXFER_DEVICE_SCOPE(device);
  cudaStream_t s = nullptr;
  // Non-blocking: the backend's copies must not serialize with the legacy default stream.
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *out = reinterpret_cast<std::uint64_t>(s);
  return e == cudaSuccess ? std::string() : fail("cudaStreamCreateWithFlags", e);
}

std::string stream_destroy(std::uint64_t s) {
  drop_stream_counter(s);  // the caller has drained the stream: no kernel reads it any more
  cudaError_t e = cudaStreamDestroy(reinterpret_cast<cudaStream_t>(s));
  return e == cudaSuccess ? std::string() : fail("cudaStreamDestroy", e);
}

std::string stream_synchronize(std::uint64_t s, int device) {
  // With `device`, stream 0 names that device's default stream, not the current device's.
  KVXFER_DEVICE_SCOPE(device);
  cudaError_t e = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(s));
  return e == cudaSuccess ? std::string() : fail("cudaStreamSynchronize", e);
}

std::string event_create(int device, std::uint64_t* out) {
  KVXFER_DEVICE_SCOPE(device);
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  *out = reinterpret_cast<std::uint64_t>(ev);
  return e == cudaSuccess ? std::string() : fail("cudaEventCreateWithFlags", e);
}

std::string event_record(std::uint64_t ev, std::uint64_t s) {
  cudaError_t e = cudaEventRecord(reinterpret_cast<cudaEvent_t>(ev), reinterpret_cast<cudaStream_t>(s));
  return e == cudaSuccess ? std::string() : fail("cudaEventRecord", e);
}

std::string event_query(std::uint64_t ev, bool* done) {
  cudaError_t e = cudaEventQuery(reinterpret_cast<cudaEvent_t>(ev));
  *done = e == cudaSuccess;
  if (e == cudaSuccess || e == cudaErrorNotReady) {
    if (e == cudaErrorNotReady) (void)cudaGetLastError();
    return {};
  }
  return fail("cudaEventQuery", e);
}

std::string event_spin(std::uint64_t ev, std::int64_t timeout_us, bool* done) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  for (;;) {
    std::string err = event_query(ev, done);
    if (!err.empty() || *done || std::chrono::steady_clock::now() >= end) return err;
    cpu_relax();
  }
}

std::string event_spin_send(std::uint64_t ev, std::int64_t spin_us, int fd, const char* frame, std::size_t len,
                            bool* done, std::int64_t* sent, const unsigned char* check, std::size_t check_rows) {
  *sent = 0;
  std::string err = event_spin(ev, spin_us, done);
  if (!err.empty() || !*done || fd < 0) return err;
  // The row check's verdicts, written by the kernel that the event follows: any row that
  // failed, and the frame (DELIVERED) does not go.
  for (std::size_t i = 0; i < check_rows; ++i) {
    if (check[i] != 0) return {};
  }
  ssize_t n = ::send(fd, frame, len, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n >= 0) *sent = n;
  else if (errno != EAGAIN && errno != EWOULDBLOCK) *sent = -errno;
  return {};
}

std::string event_synchronize(std::uint64_t ev) {
  cudaError_t e = cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(ev));
  return e == cudaSuccess ? std::string() : fail("cudaEventSynchronize", e);
}

std::string event_destroy(std::uint64_t ev) {
  cudaError_t e = cudaEventDestroy(reinterpret_cast<cudaEvent_t>(ev));
  return e == cudaSuccess ? std::string() : fail("cudaEventDestroy", e);
}

namespace {
void CUDART_CB write_byte(void* fd) {
  const char one = 1;
  // A full pipe already holds a pending wake-up, so a failed write loses nothing.
  ssize_t r = ::write(static_cast<int>(reinterpret_cast<std::intptr_t>(fd)), &one, 1);
  (void)r;
}
}  // namespace

std::string stream_signal_fd(std::uint64_t s, int fd) {
  cudaError_t e = cudaLaunchHostFunc(reinterpret_cast<cudaStream_t>(s), write_byte,
                                     reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)));
  return e == cudaSuccess ? std::string() : fail("cudaLaunchHostFunc", e);
}

namespace {
// One thread stores `value` once every kernel queued before it on the stream has ended: a
// host page that a peer polls then says "your rows are in place" without a CPU in between.
// The fence orders nothing of the earlier kernels (their writes completed at the kernel
// boundary); it makes this store visible to the host before the kernel counts as done.
__global__ void write_word_kernel(unsigned long long* word, unsigned long long value) {
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long*>(word) = value;
  __threadfence_system();
}
}  // namespace

std::string host_register(int device, std::uint64_t ptr, std::uint64_t bytes, std::uint64_t* device_ptr) {
  KVXFER_DEVICE_SCOPE(device);
  void* p = reinterpret_cast<void*>(ptr);
  cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) return fail("cudaHostRegister", e);
  void* d = nullptr;
  e = cudaHostGetDevicePointer(&d, p, 0);
  if (e != cudaSuccess) {
    std::string err = fail("cudaHostGetDevicePointer", e);
    (void)cudaHostUnregister(p);
    return err;
  }
  *device_ptr = reinterpret_cast<std::uint64_t>(d);
  return {};
}

std::string host_unregister(int device, std::uint64_t ptr) {
  KVXFER_DEVICE_SCOPE(device);
  cudaError_t e = cudaHostUnregister(reinterpret_cast<void*>(ptr));
  return e == cudaSuccess ? std::string() : fail("cudaHostUnregister", e);
}

std::string stream_write_word(int device, std::uint64_t s, std::uint64_t device_ptr, std::uint64_t value) {
  if (device_ptr % 8 != 0) return "stream_write_word: the word's address is not 8-byte aligned";
  KVXFER_DEVICE_SCOPE(device);
  write_word_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(s)>>>(
      reinterpret_cast<unsigned long long*>(device_ptr), static_cast<unsigned long long>(value));
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : fail("launching the word write", e);
}

std::string copy_rows_then(const CopyPlan& plan, int device, std::uint64_t stream, std::uint64_t bell_ptr,
                           std::uint64_t bell_value, std::uint64_t event, std::string* bell_err,
                           std::string* event_err, const RowCheck* check) {
  Signal sig{reinterpret_cast<unsigned long long*>(bell_ptr), bell_value, nullptr};
  bool rang = false;
  if (bell_ptr != 0 && bell_ptr % 8 == 0 && plan.n_rows <= kInlineRows) {
    std::string counter_err = stream_counter(device, stream, &sig.counter);
    if (!counter_err.empty()) sig.bell = nullptr;  // the separate store below, then
  } else {
    sig.bell = nullptr;
  }
  std::string err = copy_rows_signal(plan, false, device, stream, sig.bell != nullptr ? &sig : nullptr, &rang, check);
  if (!err.empty()) return err;
  // A checked copy rings only from its kernel, which knows whether every row checked out; the
  // store below could not, so the socket's record tells the passive end instead.
  const bool checked = check != nullptr && check->out != 0;
  if (bell_ptr != 0 && !rang && !checked) *bell_err = stream_write_word(device, stream, bell_ptr, bell_value);
  if (event != 0) *event_err = event_record(event, stream);
  return {};
}

std::string ipc_export(int device, std::uint64_t ptr, std::string* handle, std::uint64_t* base, std::uint64_t* size) {
  KVXFER_DEVICE_SCOPE(device);
  // The allocation's base and size come from the driver; asking for its entry point through
  // the runtime keeps libcuda out of the link, so the module imports on machines without it.
  using AddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess) return fail("looking up cuMemGetAddressRange", e);
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) return "cuMemGetAddressRange is not available from the driver";
  CUdeviceptr b = 0;
  size_t n = 0;
  CUresult r = reinterpret_cast<AddressRange>(fn)(&b, &n, static_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS)
    return "cuMemGetAddressRange failed (error " + std::to_string(static_cast<int>(r)) +
           "): the address is not device memory of this process";
  cudaIpcMemHandle_t h;
  e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(b));
  if (e != cudaSuccess)
    return fail("cudaIpcGetMemHandle (memory from cuMemCreate/expandable segments cannot be exported this way)", e);
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  *base = static_cast<std::uint64_t>(b);
  *size = static_cast<std::uint64_t>(n);
  return {};
}

std::string ipc_open(int device, const std::string& handle, std::uint64_t* base) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    return "an IPC handle is " + std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes, got " +
           std::to_string(handle.size());
  KVXFER_DEVICE_SCOPE(device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  *base = reinterpret_cast<std::uint64_t>(p);
  return e == cudaSuccess ? std::string() : fail("cudaIpcOpenMemHandle", e);
}

std::string ipc_close(int device, std::uint64_t base) {
  KVXFER_DEVICE_SCOPE(device);
  cudaError_t e = cudaIpcCloseMemHandle(reinterpret_cast<void*>(base));
  return e == cudaSuccess ? std::string() : fail("cudaIpcCloseMemHandle", e);
}

std::string device_alloc(int device, std::uint64_t bytes, std::uint64_t* ptr) {
  KVXFER_DEVICE_SCOPE(device);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  *ptr = reinterpret_cast<std::uint64_t>(p);
  return e == cudaSuccess ? std::string() : fail("cudaMalloc", e);
}

std::string device_free(int device, std::uint64_t ptr) {
  KVXFER_DEVICE_SCOPE(device);
  cudaError_t e = cudaFree(reinterpret_cast<void*>(ptr));
  return e == cudaSuccess ? std::string() : fail("cudaFree", e);
}

std::string copy_bytes(int device, std::uint64_t dst, std::uint64_t src, std::uint64_t bytes) {
  KVXFER_DEVICE_SCOPE(device);
  cudaError_t e = cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, cudaMemcpyDefault);
  return e == cudaSuccess ? std::string() : fail("cudaMemcpy", e);
}

}  // namespace kvxfer::cuda
