// One-launch batched row copy on the GPU, and the small set of runtime calls the IPC backend
// needs (streams, events, IPC handles). The grid is flattened over (row, chunk) items: each
// block copies one chunk of one row with vector loads of the widest width that every row
// start is aligned to; the bytes past the last whole vector of a row (the tail) are copied
// bytewise by the block that owns the row's last chunk, so any row size is correct.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "cuda_api.h"

namespace kvxfer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;         // loads in flight per thread before the stores
constexpr int kInlineRows = 64;    // 2 x 64 x 8 B of indices ride in the launch parameters
constexpr std::int64_t kMaxGrid = 1ll << 20;

std::string fail(const char* what, cudaError_t err) {
  // Clear the sticky "last error" of a non-fatal failure so a later call is not blamed.
  (void)cudaGetLastError();
  return std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

// Runs with `device` current and restores the caller's device afterwards, so that embedding
// frameworks (torch) keep their notion of the current device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (device < 0) return;
    err_ = cudaGetDevice(&previous_);
    if (err_ == cudaSuccess && previous_ != device) {
      err_ = cudaSetDevice(device);
      switched_ = err_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  cudaError_t error() const { return err_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t err_ = cudaSuccess;
};

template <int W> struct Vec;
template <> struct Vec<16> { using T = uint4; };
template <> struct Vec<8> { using T = uint2; };
template <> struct Vec<4> { using T = unsigned int; };
template <> struct Vec<1> { using T = unsigned char; };

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
  std::int64_t chunk_bytes;     // kThreads * kUnroll * W
  std::int64_t chunks_per_row;
};

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

template <int W, typename Ix>
__global__ void __launch_bounds__(kThreads) rowcopy_kernel(Geometry g, Ix ix) {
  using V = typename Vec<W>::T;
  const std::int64_t items = g.n_rows * g.chunks_per_row;
  for (std::int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const std::int64_t row = item / g.chunks_per_row;
    const std::int64_t chunk = item - row * g.chunks_per_row;
    const unsigned char* s = g.src + src_slot(ix, row) * g.src_stride;
    unsigned char* d = g.dst + dst_slot(ix, row) * g.dst_stride;
    const std::int64_t begin = chunk * g.chunk_bytes;
    const std::int64_t body_end = min(begin + g.chunk_bytes, g.body_bytes);
    if (body_end > begin) {
      const V* sv = reinterpret_cast<const V*>(s + begin);
      V* dv = reinterpret_cast<V*>(d + begin);
      const int n = static_cast<int>((body_end - begin) / W);
      V tmp[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = threadIdx.x + u * kThreads;
        if (j < n) tmp[u] = sv[j];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = threadIdx.x + u * kThreads;
        if (j < n) dv[j] = tmp[u];
      }
    }
    if (chunk == g.chunks_per_row - 1) {
      for (std::int64_t b = g.body_bytes + threadIdx.x; b < g.row_bytes; b += kThreads) d[b] = s[b];
    }
  }
}

template <typename Ix>
cudaError_t launch(int width, const Geometry& g, const Ix& ix, cudaStream_t stream, std::int64_t grid) {
  const dim3 blocks(static_cast<unsigned>(grid)), threads(kThreads);
  switch (width) {
    case 16: rowcopy_kernel<16, Ix><<<blocks, threads, 0, stream>>>(g, ix); break;
    case 8: rowcopy_kernel<8, Ix><<<blocks, threads, 0, stream>>>(g, ix); break;
    case 4: rowcopy_kernel<4, Ix><<<blocks, threads, 0, stream>>>(g, ix); break;
    default: rowcopy_kernel<1, Ix><<<blocks, threads, 0, stream>>>(g, ix); break;
  }
  return cudaGetLastError();
}

}  // namespace

std::string copy_rows(const CopyPlan& p, bool indices_on_device, int device, std::uint64_t stream_handle) {
  std::string err = check_plan(p);
  if (!err.empty() || p.n_rows == 0 || p.row_bytes == 0) return err;
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);

  const int width = vector_width(p);
  Geometry g{};
  g.src = reinterpret_cast<const unsigned char*>(p.src.base);
  g.dst = reinterpret_cast<unsigned char*>(p.dst.base);
  g.src_stride = p.src.stride;
  g.dst_stride = p.dst.stride;
  g.n_rows = p.n_rows;
  g.row_bytes = p.row_bytes;
  g.body_bytes = p.row_bytes - p.row_bytes % width;
  g.chunk_bytes = static_cast<std::int64_t>(kThreads) * kUnroll * width;
  g.chunks_per_row = std::max<std::int64_t>(1, (g.body_bytes + g.chunk_bytes - 1) / g.chunk_bytes);
  const std::int64_t grid = std::min(p.n_rows * g.chunks_per_row, kMaxGrid);

  if (indices_on_device) {
    cudaError_t e = launch(width, g, Indices{p.src.index, p.dst.index}, stream, grid);
    return e == cudaSuccess ? std::string() : fail("launching the row copy kernel", e);
  }
  if (p.n_rows <= kInlineRows) {
    // Small submissions (the latency case) skip the index upload entirely.
    InlineIndices ix{};
    ix.has_src = p.src.index != nullptr;
    ix.has_dst = p.dst.index != nullptr;
    if (ix.has_src) std::memcpy(ix.src, p.src.index, sizeof(std::int64_t) * p.n_rows);
    if (ix.has_dst) std::memcpy(ix.dst, p.dst.index, sizeof(std::int64_t) * p.n_rows);
    cudaError_t e = launch(width, g, ix, stream, grid);
    return e == cudaSuccess ? std::string() : fail("launching the row copy kernel", e);
  }
  // Stream-ordered scratch: allocated, filled, used and freed in stream order, so the call
  // never waits for the device. A pageable source is staged by the runtime before return.
  const int arrays = (p.src.index ? 1 : 0) + (p.dst.index ? 1 : 0);
  const std::size_t one = sizeof(std::int64_t) * static_cast<std::size_t>(p.n_rows);
  void* scratch = nullptr;
  cudaError_t e = cudaMallocAsync(&scratch, one * arrays, stream);
  if (e != cudaSuccess) return fail("allocating index scratch (cudaMallocAsync)", e);
  Indices ix{nullptr, nullptr};
  auto* cursor = static_cast<unsigned char*>(scratch);
  if (p.src.index) {
    e = cudaMemcpyAsync(cursor, p.src.index, one, cudaMemcpyHostToDevice, stream);
    ix.src = reinterpret_cast<const std::int64_t*>(cursor);
    cursor += one;
  }
  if (e == cudaSuccess && p.dst.index) {
    e = cudaMemcpyAsync(cursor, p.dst.index, one, cudaMemcpyHostToDevice, stream);
    ix.dst = reinterpret_cast<const std::int64_t*>(cursor);
  }
  if (e == cudaSuccess) {
    e = launch(width, g, ix, stream, grid);
    if (e != cudaSuccess) err = fail("launching the row copy kernel", e);
  } else {
    err = fail("uploading row indices", e);
  }
  cudaError_t f = cudaFreeAsync(scratch, stream);
  if (f != cudaSuccess && err.empty()) err = fail("freeing index scratch", f);
  return err;
}

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

std::string stream_create(int device, std::uint64_t* out) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  cudaStream_t s = nullptr;
  // Non-blocking: the backend's copies must not serialize with the legacy default stream.
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *out = reinterpret_cast<std::uint64_t>(s);
  return e == cudaSuccess ? std::string() : fail("cudaStreamCreateWithFlags", e);
}

std::string stream_destroy(std::uint64_t s) {
  cudaError_t e = cudaStreamDestroy(reinterpret_cast<cudaStream_t>(s));
  return e == cudaSuccess ? std::string() : fail("cudaStreamDestroy", e);
}

std::string stream_synchronize(std::uint64_t s) {
  cudaError_t e = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(s));
  return e == cudaSuccess ? std::string() : fail("cudaStreamSynchronize", e);
}

std::string event_create(int device, std::uint64_t* out) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
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

std::string event_synchronize(std::uint64_t ev) {
  cudaError_t e = cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(ev));
  return e == cudaSuccess ? std::string() : fail("cudaEventSynchronize", e);
}

std::string event_destroy(std::uint64_t ev) {
  cudaError_t e = cudaEventDestroy(reinterpret_cast<cudaEvent_t>(ev));
  return e == cudaSuccess ? std::string() : fail("cudaEventDestroy", e);
}

std::string ipc_export(int device, std::uint64_t ptr, std::string* handle, std::uint64_t* base, std::uint64_t* size) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
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
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  *base = reinterpret_cast<std::uint64_t>(p);
  return e == cudaSuccess ? std::string() : fail("cudaIpcOpenMemHandle", e);
}

std::string ipc_close(int device, std::uint64_t base) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  cudaError_t e = cudaIpcCloseMemHandle(reinterpret_cast<void*>(base));
  return e == cudaSuccess ? std::string() : fail("cudaIpcCloseMemHandle", e);
}

std::string device_alloc(int device, std::uint64_t bytes, std::uint64_t* ptr) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  *ptr = reinterpret_cast<std::uint64_t>(p);
  return e == cudaSuccess ? std::string() : fail("cudaMalloc", e);
}

std::string device_free(int device, std::uint64_t ptr) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  cudaError_t e = cudaFree(reinterpret_cast<void*>(ptr));
  return e == cudaSuccess ? std::string() : fail("cudaFree", e);
}

std::string copy_bytes(int device, std::uint64_t dst, std::uint64_t src, std::uint64_t bytes) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return fail("selecting the device", scope.error());
  cudaError_t e = cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, cudaMemcpyDefault);
  return e == cudaSuccess ? std::string() : fail("cudaMemcpy", e);
}

}  // namespace kvxfer::cuda
