// kvxfer._native: integer addresses, numpy int64 index arrays and integer CUDA stream and
// event handles in; nothing of torch's C++ ABI. Failures raise kvxfer._native.CopyError
// (a RuntimeError) with the native message, CUDA's error text included.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "digest.h"
#include "fill_helpers.h"
#include "rowcopy.h"
#include "spin_poll.h"
#include "transform.h"
#ifdef KVXFER_WITH_CUDA
#include "cuda_api.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

struct CopyError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Index = nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void check(const std::string& err) {
  if (!err.empty()) throw CopyError(err);
}

// Runs a native call that can block (device synchronization inside cudaFree, IPC mapping,
// page locking) without the interpreter lock, so that other Python threads (a backend's
// progress thread, a server's handlers) keep running meanwhile. f touches no Python object.
template <typename F>
void check_unlocked(F&& f) {
  std::string err;
  {
    nb::gil_scoped_release release;
    err = f();
  }
  check(err);
}

const std::int64_t* index_of(const std::optional<Index>& ix, std::int64_t n_rows, const char* what) {
  if (!ix) return nullptr;
  if (static_cast<std::int64_t>(ix->shape(0)) != n_rows)
    throw CopyError(std::string(what) + " index has " + std::to_string(ix->shape(0)) + " entries for " +
                    std::to_string(n_rows) + " rows");
  return ix->data();
}

kvxfer::CopyPlan make_plan(std::uint64_t src_base, std::int64_t src_stride, const std::int64_t* src_index,
                           std::uint64_t dst_base, std::int64_t dst_stride, const std::int64_t* dst_index,
                           std::int64_t n_rows, std::int64_t row_bytes) {
  kvxfer::CopyPlan p;
  p.src = {src_base, src_stride, src_index};
  p.dst = {dst_base, dst_stride, dst_index};
  p.n_rows = n_rows;
  p.row_bytes = row_bytes;
  check(kvxfer::check_plan(p));
  return p;
}

void host_copy_rows(std::uint64_t src_base, std::int64_t src_stride, std::optional<Index> src_index,
                    std::uint64_t dst_base, std::int64_t dst_stride, std::optional<Index> dst_index,
                    std::int64_t n_rows, std::int64_t row_bytes, int threads, std::int64_t src_limit,
                    std::int64_t dst_limit) {
  auto p = make_plan(src_base, src_stride, index_of(src_index, n_rows, "source"), dst_base, dst_stride,
                     index_of(dst_index, n_rows, "destination"), n_rows, row_bytes);
  std::string err;
  {
    nb::gil_scoped_release release;
    err = kvxfer::check_indices(p.src.index, n_rows, src_limit, "source");
    if (err.empty()) err = kvxfer::check_indices(p.dst.index, n_rows, dst_limit, "destination");
    if (err.empty()) err = kvxfer::host_copy_rows(p, threads);
  }
  check(err);
}

nb::ndarray<nb::numpy, std::uint64_t, nb::ndim<1>> host_row_digests(std::uint64_t base, std::int64_t stride,
                                                                    std::optional<Index> slots, std::int64_t n_rows,
                                                                    std::int64_t row_bytes, std::uint64_t k,
                                                                    int threads) {
  const std::int64_t* at = index_of(slots, n_rows, "slot");
  if (n_rows < 0) throw CopyError("n_rows is negative");
  auto* out = new std::uint64_t[static_cast<std::size_t>(n_rows > 0 ? n_rows : 1)]();
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
  check_unlocked([&] { return kvxfer::host_row_digests(base, stride, at, n_rows, row_bytes, k, out, threads); });
  return nb::ndarray<nb::numpy, std::uint64_t, nb::ndim<1>>(out, {static_cast<std::size_t>(n_rows)}, owner);
}

nb::ndarray<nb::numpy, std::uint64_t, nb::ndim<1>> host_segment_digests(
    Index addr, Index tokens, Index offset, Index row_bytes, std::int64_t heads, std::int64_t unit_bytes,
    std::int64_t token_stride, std::int64_t head_stride, std::int64_t canon_token, std::int64_t canon_head,
    std::uint64_t k, int threads) {
  const auto n = static_cast<std::int64_t>(addr.shape(0));
  if (static_cast<std::int64_t>(tokens.shape(0)) != n || static_cast<std::int64_t>(offset.shape(0)) != n ||
      static_cast<std::int64_t>(row_bytes.shape(0)) != n)
    throw CopyError("addr, tokens, offset and row_bytes must have one entry per segment");
  kvxfer::SegmentDigests p;
  p.addr = addr.data();
  p.tokens = tokens.data();
  p.offset = offset.data();
  p.row_bytes = row_bytes.data();
  p.n_segments = n;
  p.heads = heads;
  p.unit_bytes = unit_bytes;
  p.token_stride = token_stride;
  p.head_stride = head_stride;
  p.canon_token = canon_token;
  p.canon_head = canon_head;
  p.k = k;
  auto* out = new std::uint64_t[static_cast<std::size_t>(n > 0 ? n : 1)]();
  nb::capsule owner(out, [](void* q) noexcept { delete[] static_cast<std::uint64_t*>(q); });
  check_unlocked([&] { return kvxfer::host_segment_digests(p, out, threads); });
  return nb::ndarray<nb::numpy, std::uint64_t, nb::ndim<1>>(out, {static_cast<std::size_t>(n)}, owner);
}

// The segment arrays of a layout transform, checked for equal lengths (the native checks
// the rest: geometry, tokens, addresses).
kvxfer::TransformPlan make_transform(const Index& src_addr, const Index& dst_addr, const Index& tokens,
                                     std::int64_t heads, std::int64_t unit_bytes, std::int64_t src_token_stride,
                                     std::int64_t src_head_stride, std::int64_t dst_token_stride,
                                     std::int64_t dst_head_stride) {
  const auto n = static_cast<std::int64_t>(src_addr.shape(0));
  if (static_cast<std::int64_t>(dst_addr.shape(0)) != n || static_cast<std::int64_t>(tokens.shape(0)) != n)
    throw CopyError("src_addr, dst_addr and tokens must have one entry per segment; got " + std::to_string(n) + ", " +
                    std::to_string(dst_addr.shape(0)) + " and " + std::to_string(tokens.shape(0)));
  kvxfer::TransformPlan p;
  p.src_addr = src_addr.data();
  p.dst_addr = dst_addr.data();
  p.tokens = tokens.data();
  p.n_segments = n;
  p.heads = heads;
  p.unit_bytes = unit_bytes;
  p.src_token_stride = src_token_stride;
  p.src_head_stride = src_head_stride;
  p.dst_token_stride = dst_token_stride;
  p.dst_head_stride = dst_head_stride;
  return p;
}

void host_transform_copy(Index src_addr, Index dst_addr, Index tokens, std::int64_t heads, std::int64_t unit_bytes,
                         std::int64_t src_token_stride, std::int64_t src_head_stride, std::int64_t dst_token_stride,
                         std::int64_t dst_head_stride, int threads) {
  auto p = make_transform(src_addr, dst_addr, tokens, heads, unit_bytes, src_token_stride, src_head_stride,
                          dst_token_stride, dst_head_stride);
  check_unlocked([&] { return kvxfer::host_transform(p, threads); });
}

#ifdef KVXFER_WITH_CUDA
void cuda_transform_copy(Index src_addr, Index dst_addr, Index tokens, std::int64_t heads, std::int64_t unit_bytes,
                         std::int64_t src_token_stride, std::int64_t src_head_stride, std::int64_t dst_token_stride,
                         std::int64_t dst_head_stride, std::uint64_t stream, int device) {
  auto p = make_transform(src_addr, dst_addr, tokens, heads, unit_bytes, src_token_stride, src_head_stride,
                          dst_token_stride, dst_head_stride);
  check_unlocked([&] { return kvxfer::cuda::transform_copy(p, device, stream); });
}

std::tuple<std::string, std::string> cuda_transform_copy_then(
    Index src_addr, Index dst_addr, Index tokens, std::int64_t heads, std::int64_t unit_bytes,
    std::int64_t src_token_stride, std::int64_t src_head_stride, std::int64_t dst_token_stride,
    std::int64_t dst_head_stride, std::uint64_t stream, int device, std::uint64_t bell_ptr, std::uint64_t bell_value,
    std::uint64_t event) {
  auto p = make_transform(src_addr, dst_addr, tokens, heads, unit_bytes, src_token_stride, src_head_stride,
                          dst_token_stride, dst_head_stride);
  std::string bell_err, event_err;
  check_unlocked([&] {
    return kvxfer::cuda::transform_copy_then(p, device, stream, bell_ptr, bell_value, event, &bell_err, &event_err);
  });
  return {bell_err, event_err};
}

void cuda_copy_rows(std::uint64_t src_base, std::int64_t src_stride, std::optional<Index> src_index,
                    std::uint64_t dst_base, std::int64_t dst_stride, std::optional<Index> dst_index,
                    std::int64_t n_rows, std::int64_t row_bytes, std::uint64_t stream, int device,
                    std::int64_t src_limit, std::int64_t dst_limit, std::uint64_t check_ptr, std::uint64_t check_k,
                    bool corrupt) {
  auto p = make_plan(src_base, src_stride, index_of(src_index, n_rows, "source"), dst_base, dst_stride,
                     index_of(dst_index, n_rows, "destination"), n_rows, row_bytes);
  const kvxfer::cuda::RowCheck rc{check_ptr, check_k, corrupt};
  std::string err;
  {
    nb::gil_scoped_release release;
    err = kvxfer::check_indices(p.src.index, n_rows, src_limit, "source");
    if (err.empty()) err = kvxfer::check_indices(p.dst.index, n_rows, dst_limit, "destination");
    if (err.empty()) err = kvxfer::cuda::copy_rows(p, false, device, stream, &rc);
  }
  check(err);
}

std::tuple<std::string, std::string> cuda_copy_rows_then(
    std::uint64_t src_base, std::int64_t src_stride, std::optional<Index> src_index, std::uint64_t dst_base,
    std::int64_t dst_stride, std::optional<Index> dst_index, std::int64_t n_rows, std::int64_t row_bytes,
    std::uint64_t stream, int device, std::uint64_t bell_ptr, std::uint64_t bell_value, std::uint64_t event,
    std::uint64_t check_ptr, std::uint64_t check_k, bool corrupt) {
  auto p = make_plan(src_base, src_stride, index_of(src_index, n_rows, "source"), dst_base, dst_stride,
                     index_of(dst_index, n_rows, "destination"), n_rows, row_bytes);
  const kvxfer::cuda::RowCheck rc{check_ptr, check_k, corrupt};
  std::string err, bell_err, event_err;
  {
    nb::gil_scoped_release release;
    err = kvxfer::cuda::copy_rows_then(p, device, stream, bell_ptr, bell_value, event, &bell_err, &event_err, &rc);
  }
  check(err);
  return {bell_err, event_err};
}

void cuda_copy_rows_device(std::uint64_t src_base, std::int64_t src_stride, std::uint64_t src_index_ptr,
                           std::uint64_t dst_base, std::int64_t dst_stride, std::uint64_t dst_index_ptr,
                           std::int64_t n_rows, std::int64_t row_bytes, std::uint64_t stream, int device) {
  auto p = make_plan(src_base, src_stride, reinterpret_cast<const std::int64_t*>(src_index_ptr), dst_base,
                     dst_stride, reinterpret_cast<const std::int64_t*>(dst_index_ptr), n_rows, row_bytes);
  std::string err;
  {
    nb::gil_scoped_release release;
    err = kvxfer::cuda::copy_rows(p, true, device, stream);
  }
  check(err);
}

std::uint64_t out_handle(std::string (*fn)(int, std::uint64_t*), int device) {
  std::uint64_t h = 0;
  check(fn(device, &h));
  return h;
}
#endif

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "kvxfer's compiled row copy (host always; CUDA when built with it).";
  nb::exception<CopyError>(m, "CopyError", PyExc_RuntimeError);
#ifdef KVXFER_WITH_CUDA
  m.attr("HAS_CUDA") = true;
#else
  m.attr("HAS_CUDA") = false;
#endif
  m.attr("ABI_VERSION") = 1;
  m.attr("HAS_TRANSFORM") = true;  // host_transform_copy, and cuda_transform_copy(_then) with CUDA
  m.attr("HAS_DIGEST") = true;     // host_row_digests
  m.attr("HAS_SEGMENT_DIGEST") = true;  // host_segment_digests

  m.def("fill_helper_threads", [] { return kvxfer::FillHelpers::instance().threads(); },
        "How many persistent index-fill helper threads are running (started by large CUDA copies).");
  m.def("stop_fill_helpers", [] {
        nb::gil_scoped_release release;
        kvxfer::FillHelpers::instance().stop();
      },
      "Join the index-fill helper threads (after a copy using them ends); the next large copy starts them again.");

  m.def("spin_poll", [](const std::vector<int>& fds, std::int64_t timeout_us, std::uint64_t words,
                        std::optional<Index> slots) {
        bool ready = false;
        std::string err;
        const std::int64_t* at = slots ? slots->data() : nullptr;
        const std::size_t n = slots ? slots->shape(0) : 0;
        if (n && words == 0) throw nb::value_error("spin_poll: slots given without a words address");
        {
          nb::gil_scoped_release release;
          err = kvxfer::spin_poll(fds, timeout_us, reinterpret_cast<const volatile std::uint64_t*>(words), at, n,
                                  &ready);
        }
        check(err);
        return ready;
      }, "fds"_a, "timeout_us"_a, "words"_a = 0, "slots"_a.noconvert().none() = nb::none(),
      "Poll fds for input in a loop, without sleeping and with the GIL released, for up to timeout_us: True as "
      "soon as one has input (or an error or hang-up), or one of the 8-byte words at words + 8 * slots[i] is "
      "non-zero; False when the time ran out.");

  m.def("host_copy_rows", &host_copy_rows, "src_base"_a, "src_stride"_a, "src_index"_a.noconvert().none(), "dst_base"_a,
        "dst_stride"_a, "dst_index"_a.noconvert().none(), "n_rows"_a, "row_bytes"_a, "threads"_a = 0, "src_limit"_a = -1,
        "dst_limit"_a = -1,
        "Copy n_rows rows of row_bytes from base+index[i]*stride (index None: i) on one end to the other, in host "
        "memory. Indices outside [0, limit) are refused when a limit is given.");

  m.def("host_row_digests", &host_row_digests, "base"_a, "stride"_a, "slots"_a.noconvert().none(), "n_rows"_a,
        "row_bytes"_a, "k"_a, "threads"_a = 0,
        "The row digest (kvxfer.backends.common.integrity) of the row_bytes bytes at base + slots[i] * stride "
        "(slots None: i) for each i < n_rows, read in place with the GIL released, as a new uint64 array. A negative "
        "slot is refused; nothing checks an upper bound (the caller's rows must be mapped).");

  m.def("host_segment_digests", &host_segment_digests, "addr"_a.noconvert(), "tokens"_a.noconvert(),
        "offset"_a.noconvert(), "row_bytes"_a.noconvert(), "heads"_a, "unit_bytes"_a, "token_stride"_a,
        "head_stride"_a, "canon_token"_a, "canon_head"_a, "k"_a, "threads"_a = 0,
        "Each segment's share of the row digest of the row it lands in (digest.h): its units, read at addr[s] + t * "
        "token_stride + h * head_stride, placed at byte offset[s] + t * canon_token + h * canon_head of a row of "
        "row_bytes[s] bytes. int64 arrays; a new uint64 array; the GIL released.");

  m.def("host_transform_copy", &host_transform_copy, "src_addr"_a.noconvert(), "dst_addr"_a.noconvert(),
        "tokens"_a.noconvert(), "heads"_a, "unit_bytes"_a, "src_token_stride"_a, "src_head_stride"_a,
        "dst_token_stride"_a, "dst_head_stride"_a, "threads"_a = 0,
        "Layout transform in host memory: for each segment i, token t < tokens[i] and head h < heads, copy "
        "unit_bytes from src_addr[i] + t * src_token_stride + h * src_head_stride to the same place on the dst end. "
        "int64 arrays; checked before anything is copied.");

#ifdef KVXFER_WITH_CUDA
  m.def("cuda_transform_copy", &cuda_transform_copy, "src_addr"_a.noconvert(), "dst_addr"_a.noconvert(),
        "tokens"_a.noconvert(), "heads"_a, "unit_bytes"_a, "src_token_stride"_a, "src_head_stride"_a,
        "dst_token_stride"_a, "dst_head_stride"_a, "stream"_a, "device"_a = -1,
        "host_transform_copy over device memory: one kernel queued on `stream` (an integer cudaStream_t; 0 = "
        "legacy default) of `device` (-1: current). Host int64 arrays. Returns once queued.");
  m.def("cuda_transform_copy_then", &cuda_transform_copy_then, "src_addr"_a.noconvert(), "dst_addr"_a.noconvert(),
        "tokens"_a.noconvert(), "heads"_a, "unit_bytes"_a, "src_token_stride"_a, "src_head_stride"_a,
        "dst_token_stride"_a, "dst_head_stride"_a, "stream"_a, "device"_a, "bell_ptr"_a, "bell_value"_a, "event"_a,
        "cuda_transform_copy, then on the same stream the 8-byte store of bell_value at bell_ptr (0: none) and the "
        "record of event (0: none), in one call. Raises CopyError if the copy was not queued; else returns (store "
        "error, event error), empty strings when they were queued.");
  m.def("cuda_copy_rows", &cuda_copy_rows, "src_base"_a, "src_stride"_a, "src_index"_a.noconvert().none(), "dst_base"_a,
        "dst_stride"_a, "dst_index"_a.noconvert().none(), "n_rows"_a, "row_bytes"_a, "stream"_a, "device"_a = -1,
        "src_limit"_a = -1, "dst_limit"_a = -1, "check_ptr"_a = 0, "check_k"_a = 0, "corrupt"_a = false,
        "Queue one row-copy kernel on `stream` (an integer cudaStream_t; 0 = legacy default). Host int64 indices. "
        "Returns once queued; the copy is complete when an event recorded after it completes. check_ptr (the "
        "device address of host memory mapped for the device, one byte per row; 0: none): the kernel takes each "
        "row's digest (constant check_k) over the bytes it read and over the bytes read back where it wrote them, "
        "and writes 0 (the same) or 1 there per row; corrupt: rows whose byte is 0xFE get one bit flipped where "
        "they landed before the read-back (a test hook).");
  m.def("cuda_copy_rows_then", &cuda_copy_rows_then, "src_base"_a, "src_stride"_a, "src_index"_a.noconvert().none(),
        "dst_base"_a, "dst_stride"_a, "dst_index"_a.noconvert().none(), "n_rows"_a, "row_bytes"_a, "stream"_a,
        "device"_a, "bell_ptr"_a, "bell_value"_a, "event"_a, "check_ptr"_a = 0, "check_k"_a = 0, "corrupt"_a = false,
        "cuda_copy_rows (indices not bounds-checked), then on the same stream the 8-byte store of bell_value at "
        "bell_ptr (0: none) and the record of event (0: none), in one call. Raises CopyError if the copy was not "
        "queued; else returns (store error, event error), empty strings when they were queued. With check_ptr "
        "(as cuda_copy_rows), the doorbell rings only from a small copy's kernel and only if every row checked out.");
  m.def("cuda_copy_rows_device", &cuda_copy_rows_device, "src_base"_a, "src_stride"_a, "src_index_ptr"_a,
        "dst_base"_a, "dst_stride"_a, "dst_index_ptr"_a, "n_rows"_a, "row_bytes"_a, "stream"_a, "device"_a = -1,
        "As cuda_copy_rows, with int64 index arrays already in device memory (0 = contiguous). Not bounds-checked.");
  m.def("versions", [] {
    int runtime = 0, driver = 0;
    check(kvxfer::cuda::versions(&runtime, &driver));
    return std::make_tuple(runtime, driver);
  }, "(runtime, driver) CUDA versions as integers, e.g. 13000.");
  m.def("device_count", [] {
    int n = 0;
    check(kvxfer::cuda::device_count(&n));
    return n;
  });
  m.def("peer_access", [](int device, int peer) {
    bool enabled = false;
    check_unlocked([&] { return kvxfer::cuda::peer_access(device, peer, &enabled); });
    return enabled;
  }, "device"_a, "peer"_a, "Enable kernels on device to reach peer's memory (peer != device); False where the hardware cannot.");
  m.def("stream_create", [](int device) { return out_handle(kvxfer::cuda::stream_create, device); }, "device"_a);
  m.def("stream_destroy", [](std::uint64_t s) { check_unlocked([&] { return kvxfer::cuda::stream_destroy(s); }); }, "stream"_a);
  m.def("stream_synchronize", [](std::uint64_t s, int device) {
    check_unlocked([&] { return kvxfer::cuda::stream_synchronize(s, device); });
  }, "stream"_a, "device"_a = -1, "Wait for stream's work; stream 0 is device's default stream (-1: the current device).");
  m.def("event_create", [](int device) { return out_handle(kvxfer::cuda::event_create, device); }, "device"_a);
  m.def("event_record", [](std::uint64_t ev, std::uint64_t s) { check(kvxfer::cuda::event_record(ev, s)); },
        "event"_a, "stream"_a);
  m.def("event_query", [](std::uint64_t ev) {
    bool done = false;
    check(kvxfer::cuda::event_query(ev, &done));
    return done;
  }, "event"_a, "True once the work before the event completed; raises CopyError if it failed.");
  m.def("event_spin_send", [](std::uint64_t ev, std::int64_t spin_us, int fd, nb::bytes frame,
                              std::uint64_t check_host, std::uint64_t check_rows) {
    bool done = false;
    std::int64_t sent = 0;
    std::string err;
    {
      nb::gil_scoped_release release;
      err = kvxfer::cuda::event_spin_send(ev, spin_us, fd, frame.c_str(), frame.size(), &done, &sent,
                                          reinterpret_cast<const unsigned char*>(check_host),
                                          static_cast<std::size_t>(check_rows));
    }
    check(err);
    return std::make_tuple(done, sent);
  }, "event"_a, "spin_us"_a, "fd"_a, "frame"_a, "check_host"_a = 0, "check_rows"_a = 0,
        "Spin up to spin_us for the event (the GIL released), then write frame to the non-blocking socket fd "
        "(-1: none). Returns (done, sent): sent is the bytes written, 0 if not done or the socket was full, "
        "-errno if the write failed. Raises CopyError if the work failed. With check_host (the host address of a "
        "checked copy's row verdicts, check_rows bytes), the frame goes only if every one is 0.");
  m.def("event_synchronize", [](std::uint64_t ev) {
    check_unlocked([&] { return kvxfer::cuda::event_synchronize(ev); });
  }, "event"_a);
  m.def("stream_signal_fd", [](std::uint64_t s, int fd) { check(kvxfer::cuda::stream_signal_fd(s, fd)); },
        "stream"_a, "fd"_a, "Write one byte to fd once the work queued on stream so far has completed.");
  m.def("event_destroy", [](std::uint64_t ev) { check(kvxfer::cuda::event_destroy(ev)); }, "event"_a);
  m.def("ipc_export", [](int device, std::uint64_t ptr) {
    std::string handle;
    std::uint64_t base = 0, size = 0;
    check(kvxfer::cuda::ipc_export(device, ptr, &handle, &base, &size));
    return std::make_tuple(nb::bytes(handle.data(), handle.size()), base, size);
  }, "device"_a, "ptr"_a, "(handle bytes, allocation base, allocation size) of the allocation holding ptr.");
  m.def("ipc_open", [](int device, nb::bytes handle) {
    std::uint64_t base = 0;
    const std::string raw(handle.c_str(), handle.size());
    check_unlocked([&] { return kvxfer::cuda::ipc_open(device, raw, &base); });
    return base;
  }, "device"_a, "handle"_a, "Map a peer's allocation; returns its base in this process.");
  m.def("ipc_close", [](int device, std::uint64_t base) {
    check_unlocked([&] { return kvxfer::cuda::ipc_close(device, base); });
  },
        "device"_a, "base"_a);
  m.def("host_register", [](int device, std::uint64_t ptr, std::uint64_t bytes) {
    std::uint64_t d = 0;
    check_unlocked([&] { return kvxfer::cuda::host_register(device, ptr, bytes, &d); });
    return d;
  }, "device"_a, "ptr"_a, "bytes"_a,
        "Page-lock and map host memory for the device (cudaHostRegister, mapped); returns its device address.");
  m.def("host_unregister", [](int device, std::uint64_t ptr) {
    check_unlocked([&] { return kvxfer::cuda::host_unregister(device, ptr); });
  },
        "device"_a, "ptr"_a);
  m.def("stream_write_word", [](int device, std::uint64_t s, std::uint64_t ptr, std::uint64_t value) {
    check(kvxfer::cuda::stream_write_word(device, s, ptr, value));
  }, "device"_a, "stream"_a, "ptr"_a, "value"_a,
        "Queue on stream an 8-byte store of value at ptr (device-visible), after the work queued before it.");
  m.def("device_alloc", [](int device, std::uint64_t bytes) {
    std::uint64_t p = 0;
    check_unlocked([&] { return kvxfer::cuda::device_alloc(device, bytes, &p); });
    return p;
  }, "device"_a, "bytes"_a);
  m.def("device_free", [](int device, std::uint64_t p) {
    check_unlocked([&] { return kvxfer::cuda::device_free(device, p); });
  },
        "device"_a, "ptr"_a);
  m.attr("HAS_CUDA_DIGEST") = true;  // cuda_row_digests
  m.def("cuda_row_digests", [](int device, std::uint64_t stream, std::uint64_t base, std::int64_t stride,
                               Index slots, std::int64_t row_bytes, std::uint64_t k) {
    const auto n_rows = static_cast<std::int64_t>(slots.shape(0));
    auto* out = new std::uint64_t[static_cast<std::size_t>(n_rows > 0 ? n_rows : 1)]();
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
    const std::int64_t* at = slots.data();
    check_unlocked([&] { return kvxfer::cuda::row_digests(device, stream, base, stride, at, n_rows, row_bytes, k, out); });
    return nb::ndarray<nb::numpy, std::uint64_t, nb::ndim<1>>(out, {static_cast<std::size_t>(n_rows)}, owner);
  }, "device"_a, "stream"_a, "base"_a, "stride"_a, "slots"_a.noconvert(), "row_bytes"_a, "k"_a,
        "kvxfer's integrity digest of each row base + slots[i] * stride (device memory), as uint64; the stream drained.");
  m.def("copy_bytes", [](int device, std::uint64_t dst, std::uint64_t src, std::uint64_t n) {
    check_unlocked([&] { return kvxfer::cuda::copy_bytes(device, dst, src, n); });
  }, "device"_a, "dst"_a, "src"_a, "bytes"_a, "Synchronous cudaMemcpy in any direction (cudaMemcpyDefault).");
#endif
}
