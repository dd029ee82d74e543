// Layout transform on the GPU in one launch (transform_kernel), in W-byte vectors (W: the
// widest width every address, stride and unit_bytes allows). Small segments share a block, a
// large one is shared by several, and consecutive threads touch consecutive vectors of a
// unit and then of the unit beside it in memory. The host's share is one pass over the
// segment arrays that checks them and copies them into the launch parameters (small calls)
// or pinned staging uploaded on the caller's stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_api.h"
#include "cuda_common.cuh"
#include "transform.h"

namespace kvxfer::cuda {
namespace {

using common::DeviceScope;
using common::Vec;
using common::fail;

constexpr int kThreads = 256;
constexpr int kInlineSegs = 128;  // 3 x 8 B per segment ride in the launch parameters (3 KiB of the 4)
#if CUDART_VERSION >= 12010
// Up to 32 KiB of launch parameters (CUDA 12.1 on Volta and later): a middling call still
// skips the upload, whose latency (several microseconds) is most of its time on the GPU.
constexpr int kWideInlineSegs = 1280;
#else
constexpr int kWideInlineSegs = 0;
#endif
constexpr int kScanHelpers = 3;  // threads that share the checking pass of a large call with the caller
constexpr std::int64_t kMaxGrid = 1ll << 20;
// Vectors of one (sub)segment stay below 2^31, so that the kernel's per-segment arithmetic
// is 32-bit (64-bit division costs tens of instructions per vector); larger segments are cut
// at token boundaries on the host.
constexpr std::int64_t kMaxSegVectors = 1ll << 30;

// A divisor that is usually a power of two (vectors per unit, heads): a shift then, a
// division only where it is not.
struct Divisor {
  std::uint32_t d;
  int shift;  // >= 0: d == 1 << shift
};

Divisor divisor(std::uint32_t d) {
  for (int s = 0; s < 32; ++s) {
    if ((1u << s) == d) return {d, s};
  }
  return {d, -1};
}

__device__ __forceinline__ std::uint32_t divide(std::uint32_t x, Divisor d) {
  return d.shift >= 0 ? x >> d.shift : x / d.d;
}

struct Geometry {
  std::int64_t src_token_stride, src_head_stride, dst_token_stride, dst_head_stride;
  std::int64_t n;       // segments
  std::int64_t items;   // ceil(n / per_block) * splits: what the blocks take, one at a time
  std::int64_t splits;  // items per group of segments: a large segment is cut in that many
  Divisor vpu;          // vectors per unit
  Divisor heads;
  int group_shift;      // a segment's threads: 1 << group_shift (a warp or more), per_block in a block
  int per_block;
  bool head_inner;      // units in (token, head) order; else (head, token)
};

// The segments in device memory (staged): src[n], then dst[n], then tokens[n].
struct StagedSegs {
  const std::int64_t* v;
  __device__ __forceinline__ std::int64_t src_of(std::int64_t s, std::int64_t) const { return __ldg(v + s); }
  __device__ __forceinline__ std::int64_t dst_of(std::int64_t s, std::int64_t n) const { return __ldg(v + n + s); }
  __device__ __forceinline__ std::int64_t tokens_of(std::int64_t s, std::int64_t n) const {
    return __ldg(v + 2 * n + s);
  }
};

// Up to Cap segments in the launch parameters, laid out as staged ones are: a small call
// (the latency case) then needs no upload. A warp's threads all read one segment's entries
// (a broadcast).
template <int Cap>
struct InlineSegs {
  std::int64_t v[3 * Cap];
  __device__ __forceinline__ std::int64_t src_of(std::int64_t s, std::int64_t) const { return v[s]; }
  __device__ __forceinline__ std::int64_t dst_of(std::int64_t s, std::int64_t n) const { return v[n + s]; }
  __device__ __forceinline__ std::int64_t tokens_of(std::int64_t s, std::int64_t n) const { return v[2 * n + s]; }
};

// A block takes items: an item is per_block segments side by side (one group of threads
// each), or one of `splits` strided shares of each. A group walks its segment's vectors in
// (token, head, vector) or (head, token, vector) order, U vectors per thread per step, all
// U loads before any store so that they are in flight together; consecutive threads take
// consecutive vectors. The segment's entries are read once per item, not per vector: only
// two dependent loads stand before the data, as in the row copy.
template <int W, int U, typename Segs>
__global__ void __launch_bounds__(kThreads) transform_kernel(const Geometry g, const __grid_constant__ Segs segs) {
  using V = typename Vec<W>::T;
  const std::uint32_t group = 1u << g.group_shift;
  const std::uint32_t lane = threadIdx.x & (group - 1);
  const std::int64_t slot = threadIdx.x >> g.group_shift;
  const std::uint32_t step = group * U;
  for (std::int64_t item = blockIdx.x; item < g.items; item += gridDim.x) {
    const std::int64_t grp = g.splits == 1 ? item : item / g.splits;
    const auto split = static_cast<std::uint32_t>(item - grp * g.splits);
    const std::int64_t seg = grp * g.per_block + slot;
    if (seg >= g.n) continue;
    const std::int64_t n_tok = segs.tokens_of(seg, g.n);
    if (n_tok <= 0) continue;
    const auto* src = reinterpret_cast<const unsigned char*>(segs.src_of(seg, g.n));
    auto* dst = reinterpret_cast<unsigned char*>(segs.dst_of(seg, g.n));
    const auto tokens = static_cast<std::uint32_t>(n_tok);
    const std::uint32_t vectors = tokens * g.heads.d * g.vpu.d;
    for (std::uint32_t first = split * step; first < vectors; first += static_cast<std::uint32_t>(g.splits) * step) {
      V tmp[U];
      unsigned char* out[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        out[u] = nullptr;
        const std::uint32_t q = first + u * group + lane;
        if (q >= vectors) continue;
        const std::uint32_t unit = divide(q, g.vpu);
        const std::uint32_t vec = q - unit * g.vpu.d;
        std::uint32_t tok, head;
        if (g.head_inner) {
          tok = divide(unit, g.heads);
          head = unit - tok * g.heads.d;
        } else {
          head = unit / tokens;
          tok = unit - head * tokens;
        }
        const std::int64_t in_unit = static_cast<std::int64_t>(vec) * W;
        out[u] = dst + tok * g.dst_token_stride + head * g.dst_head_stride + in_unit;
        tmp[u] = *reinterpret_cast<const V*>(src + tok * g.src_token_stride + head * g.src_head_stride + in_unit);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (out[u] != nullptr) *reinterpret_cast<V*>(out[u]) = tmp[u];
      }
    }
  }
}

template <int U, typename Segs>
cudaError_t launch_u(int width, const Geometry& g, const Segs& segs, cudaStream_t stream) {
  const dim3 blocks(static_cast<unsigned>(std::min<std::int64_t>(g.items, kMaxGrid))), threads(kThreads);
  switch (width) {
    case 16: transform_kernel<16, U, Segs><<<blocks, threads, 0, stream>>>(g, segs); break;
    case 8: transform_kernel<8, U, Segs><<<blocks, threads, 0, stream>>>(g, segs); break;
    case 4: transform_kernel<4, U, Segs><<<blocks, threads, 0, stream>>>(g, segs); break;
    default: transform_kernel<1, U, Segs><<<blocks, threads, 0, stream>>>(g, segs); break;
  }
  return cudaGetLastError();
}

template <typename Segs>
cudaError_t launch(int width, int unroll, const Geometry& g, const Segs& segs, cudaStream_t stream) {
  return unroll == 1 ? launch_u<1>(width, g, segs, stream) : launch_u<4>(width, g, segs, stream);
}

// Segment staging: pinned host memory and device memory of one size. A pageable
// cudaMemcpyAsync is staged by the driver at a few GB/s, and a fresh allocation per call costs
// more than the copy of small calls. The upload goes on the slot's own stream, so that it
// overlaps what the caller's stream still runs (an earlier transfer's kernel) and only the
// kernel waits for it. A slot is reused once the event recorded after that kernel has
// completed (the kernel waited for the upload, so the event covers both); slots live as long
// as the process, a handful per device.
struct Slot {
  void* host = nullptr;
  void* dev = nullptr;
  std::size_t cap = 0;
  cudaEvent_t done = nullptr;
  cudaStream_t upload = nullptr;
  cudaEvent_t ready = nullptr;  // recorded on `upload` after the segments' copy
  int device = -1;
  bool busy = false;
};
std::mutex g_slots_mu;
std::vector<Slot*> g_slots;
constexpr std::size_t kMaxSlots = 16;

std::string take_slot(int device, std::size_t bytes, Slot** out) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  Slot* victim = nullptr;
  for (Slot* s : g_slots) {
    if (s->busy || s->device != device) continue;
    if (cudaEventQuery(s->done) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (s->cap >= bytes) {
      s->busy = true;
      *out = s;
      return {};
    }
    victim = s;  // idle but too small: grow it
  }
  if (victim == nullptr && g_slots.size() >= kMaxSlots) {
    for (Slot* s : g_slots) {  // all in flight: wait for one of this device
      if (s->busy || s->device != device) continue;
      cudaError_t e = cudaEventSynchronize(s->done);
      if (e != cudaSuccess) return fail("waiting for segment staging", e);
      if (s->cap >= bytes) {  // reallocating would cost more than the wait (cudaFree synchronizes)
        s->busy = true;
        *out = s;
        return {};
      }
      victim = s;
      break;
    }
    if (victim == nullptr) return "no segment staging buffer is free";
  }
  std::size_t cap = 1 << 16;
  while (cap < bytes) cap <<= 1;
  void* host = nullptr;
  void* dev = nullptr;
  cudaError_t e = cudaHostAlloc(&host, cap, cudaHostAllocPortable);
  if (e != cudaSuccess) return fail("allocating pinned segment staging", e);
  e = cudaMalloc(&dev, cap);
  if (e != cudaSuccess) {
    (void)cudaFreeHost(host);
    return fail("allocating device segment staging", e);
  }
  if (victim == nullptr) {
    auto* fresh = new Slot();
    fresh->device = device;
    e = cudaEventCreateWithFlags(&fresh->done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&fresh->ready, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&fresh->upload, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      std::string err = fail("creating a staging slot's event or stream", e);
      if (fresh->done != nullptr) (void)cudaEventDestroy(fresh->done);
      if (fresh->ready != nullptr) (void)cudaEventDestroy(fresh->ready);
      (void)cudaFreeHost(host);
      (void)cudaFree(dev);
      delete fresh;
      return err;
    }
    g_slots.push_back(fresh);
    victim = fresh;
  } else {
    // Its last kernel has completed (its event was checked above): nothing reads these now.
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

// Hands the slot back behind the work queued on `stream`. uploaded_alone: an upload was
// queued that no kernel on `stream` waits for; it is waited for here.
void give_slot(Slot* s, cudaStream_t stream, bool uploaded_alone = false) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  if (uploaded_alone) {
    (void)cudaStreamSynchronize(s->upload);
    (void)cudaGetLastError();
  }
  if (cudaEventRecord(s->done, stream) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaStreamSynchronize(stream);  // cannot track the kernel: make sure it is over
    (void)cudaGetLastError();
  }
  s->busy = false;
}

// Units next to each other in memory should be next to each other in the vector order: the
// source decides (reads stall a thread, stores do not), else the destination.
bool heads_inner(const TransformPlan& p) {
  if (p.heads == 1) return true;
  if (p.src_head_stride == p.unit_bytes) return true;
  if (p.src_token_stride == p.unit_bytes) return false;
  return p.dst_head_stride == p.unit_bytes || p.dst_token_stride != p.unit_bytes;
}

// How a call's segments spread over blocks. Returns false where a segment has 2^31 vectors or
// more, or (unless `cut`) where most items would be empty (segments of very different
// sizes): then the host cuts the segments in pieces first (cut_segments).
struct Shape {
  int width = 1, unroll = 4;
  Geometry g{};
};

bool shape_call(const TransformPlan& p, const TransformScan& scan, std::int64_t n, std::int64_t max_tokens,
                int multiprocessors, bool cut, Shape* out) {
  const int width = scan.width;
  const std::int64_t vpu = p.unit_bytes / width;
  const std::int64_t token_vectors = vpu * p.heads;
  if (max_tokens > kMaxSegVectors / token_vectors) return false;
  const std::int64_t largest = max_tokens * token_vectors;
  const std::int64_t total = scan.total_tokens * token_vectors;
  // A call of fewer vectors than two waves of 4-vector steps takes 1-vector steps instead, so
  // that it still spreads over every multiprocessor.
  const int unroll = total < static_cast<std::int64_t>(kThreads) * 4 * 2 * multiprocessors ? 1 : 4;
  int shift = 5;  // a warp per segment at least: its threads then share every entry they read
  while ((1ll << shift) * unroll < largest && (1 << shift) < kThreads) ++shift;
  const std::int64_t step = (1ll << shift) * unroll;
  const std::int64_t splits = (largest + step - 1) / step;
  const int per_block = kThreads >> shift;
  const std::int64_t items = (n + per_block - 1) / per_block * splits;
  // Empty items cost a block a few loads each: tolerated up to a few per useful one. Cut
  // segments are all about the average size, so their waste is bounded already.
  const std::int64_t useful = (total + step - 1) / step;
  if (!cut && items > 4 * useful + 2 * static_cast<std::int64_t>(multiprocessors)) return false;
  Geometry& g = out->g;
  g.src_token_stride = p.src_token_stride;
  g.src_head_stride = p.src_head_stride;
  g.dst_token_stride = p.dst_token_stride;
  g.dst_head_stride = p.dst_head_stride;
  g.n = n;
  g.items = items;
  g.splits = splits;
  g.vpu = divisor(static_cast<std::uint32_t>(vpu));
  g.heads = divisor(static_cast<std::uint32_t>(p.heads));
  g.group_shift = shift;
  g.per_block = per_block;
  g.head_inner = heads_inner(p);
  out->width = width;
  out->unroll = unroll;
  return true;
}

// The segments cut at token boundaries into pieces of at most about the average segment's
// tokens (and below 2^31 vectors), empty ones dropped: src, dst, tokens arrays back to back.
std::vector<std::int64_t> cut_segments(const TransformPlan& p, const TransformScan& scan, std::int64_t* pieces,
                                       std::int64_t* piece_tokens) {
  const std::int64_t token_vectors = (p.unit_bytes / scan.width) * p.heads;
  std::int64_t cap = (scan.total_tokens + scan.moving - 1) / scan.moving;
  cap = std::max<std::int64_t>(1, std::min(cap, kMaxSegVectors / token_vectors));
  std::int64_t m = 0;
  for (std::int64_t i = 0; i < p.n_segments; ++i) m += (std::max<std::int64_t>(0, p.tokens[i]) + cap - 1) / cap;
  std::vector<std::int64_t> out(static_cast<std::size_t>(3 * m));
  std::int64_t k = 0;
  for (std::int64_t i = 0; i < p.n_segments; ++i) {
    for (std::int64_t t0 = 0; t0 < p.tokens[i]; t0 += cap, ++k) {
      out[k] = p.src_addr[i] + t0 * p.src_token_stride;
      out[m + k] = p.dst_addr[i] + t0 * p.dst_token_stride;
      out[2 * m + k] = std::min(cap, p.tokens[i] - t0);
    }
  }
  *pieces = m;
  *piece_tokens = cap;
  return out;
}

// Queues the upload of `words` staged in `slot` and the kernel that reads them; hands the
// slot back behind them.
std::string launch_staged(Slot* slot, std::size_t words, const Shape& shape, cudaStream_t stream) {
  auto* d = static_cast<std::int64_t*>(slot->dev);
  cudaError_t e = cudaMemcpyAsync(d, slot->host, words * sizeof(std::int64_t), cudaMemcpyHostToDevice, slot->upload);
  const bool queued = e == cudaSuccess;
  if (e == cudaSuccess) e = cudaEventRecord(slot->ready, slot->upload);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, slot->ready, 0);
  if (e != cudaSuccess) {
    std::string err = fail("uploading transform segments", e);
    give_slot(slot, stream, queued);
    return err;
  }
  e = launch(shape.width, shape.unroll, shape.g, StagedSegs{d}, stream);
  give_slot(slot, stream);
  return e == cudaSuccess ? std::string() : fail("launching the transform kernel", e);
}

template <int Cap>
std::string launch_inline(const InlineSegs<Cap>& segs, const Shape& shape, cudaStream_t stream) {
  cudaError_t e = launch(shape.width, shape.unroll, shape.g, segs, stream);
  return e == cudaSuccess ? std::string() : fail("launching the transform kernel", e);
}

std::string queue_transform(const TransformPlan& p, int device, cudaStream_t stream) {
  int current = device;
  cudaError_t e = current >= 0 ? cudaSuccess : cudaGetDevice(&current);
  if (e != cudaSuccess) return fail("cudaGetDevice", e);
  const std::int64_t n = p.n_segments;
  // Small calls are read straight into the launch parameters, larger ones into pinned
  // staging; either way by the one pass that checks them.
  InlineSegs<kInlineSegs> small_segs;
  std::unique_ptr<InlineSegs<std::max(kWideInlineSegs, 1)>> wide_segs;
  Slot* slot = nullptr;
  TransformScan scan;
  if (n <= kInlineSegs) {
    scan = scan_transform_into(p, small_segs.v, 1);
  } else if (n <= kWideInlineSegs) {
    wide_segs.reset(new InlineSegs<std::max(kWideInlineSegs, 1)>);
    scan = scan_transform_into(p, wide_segs->v, 1);
  } else {
    std::string err = take_slot(current, static_cast<std::size_t>(3 * n) * sizeof(std::int64_t), &slot);
    if (!err.empty()) return err;
    scan = scan_transform_into(p, static_cast<std::int64_t*>(slot->host), 1 + kScanHelpers);
  }
  auto drop = [&](std::string err) {  // nothing was queued that reads the slot
    if (slot != nullptr) give_slot(slot, stream);
    return err;
  };
  if (!scan.error.empty() || scan.moving == 0) return drop(scan.error);
  if ((p.unit_bytes / scan.width) * p.heads > kMaxSegVectors)
    return drop("one token of heads * unit_bytes = " + std::to_string(p.heads * p.unit_bytes) +
                " bytes is too large for the transform kernel");
  int multiprocessors = 0;
  e = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, current);
  if (e != cudaSuccess) return drop(fail("reading the multiprocessor count", e));
  Shape shape;
  if (shape_call(p, scan, n, scan.max_tokens, multiprocessors, false, &shape)) {
    if (slot != nullptr) return launch_staged(slot, static_cast<std::size_t>(3 * n), shape, stream);
    return wide_segs ? launch_inline(*wide_segs, shape, stream) : launch_inline(small_segs, shape, stream);
  }
  // Segments of very different sizes, or huge ones: cut them to about the average first.
  drop({});
  slot = nullptr;
  std::int64_t m = 0, cap = 0;
  const std::vector<std::int64_t> pieces = cut_segments(p, scan, &m, &cap);
  if (!shape_call(p, scan, m, cap, multiprocessors, true, &shape)) return "cannot shape the transform kernel's launch";
  if (m <= kInlineSegs) {
    std::memcpy(small_segs.v, pieces.data(), pieces.size() * sizeof(std::int64_t));
    return launch_inline(small_segs, shape, stream);
  }
  std::string err = take_slot(current, pieces.size() * sizeof(std::int64_t), &slot);
  if (!err.empty()) return err;
  std::memcpy(slot->host, pieces.data(), pieces.size() * sizeof(std::int64_t));
  return launch_staged(slot, pieces.size(), shape, stream);
}

}  // namespace

std::string transform_copy(const TransformPlan& plan, int device, std::uint64_t stream) {
  if (plan.n_segments <= 0) return check_transform(plan);  // nothing to queue: no CUDA call either
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  return queue_transform(plan, device, reinterpret_cast<cudaStream_t>(stream));
}

std::string transform_copy_then(const TransformPlan& plan, int device, std::uint64_t stream, std::uint64_t bell_ptr,
                                std::uint64_t bell_value, std::uint64_t event, std::string* bell_err,
                                std::string* event_err) {
  std::string err = transform_copy(plan, device, stream);
  if (!err.empty()) return err;
  if (bell_ptr != 0) *bell_err = stream_write_word(device, stream, bell_ptr, bell_value);
  if (event != 0) *event_err = event_record(event, stream);
  return {};
}

}  // namespace kvxfer::cuda
