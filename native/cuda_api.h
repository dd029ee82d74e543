// The CUDA half of kvxfer's native code, declared without CUDA headers so that the bindings
// compile as plain C++. Streams, events and addresses cross this boundary as integers.
// Each call returns an empty string on success, else a message that includes CUDA's text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "rowcopy.h"

namespace kvxfer::cuda {

constexpr int kIpcHandleBytes = 64;

// The row check of a copy: kvxfer's integrity digest (kvxfer/backends/common/integrity.py) of
// each row, taken in the copy kernel over the bytes it read and over the bytes it reads back
// where it wrote them. `out`: the device address of host memory mapped for the device
// (host_register), one byte per row of the copy; once the copy has completed, out[i] is 0 when
// row i's two digests agree, else 1 (bytes the kernel never wrote keep what was there: write
// 0xFF first). `k`: the digest's constant. `corrupt`: a test hook: rows whose out byte is 0xFE
// when the copy starts get one bit flipped where they landed, after their store and before the
// read-back. out == 0: no check.
struct RowCheck {
  std::uint64_t out = 0;
  std::uint64_t k = 0;
  bool corrupt = false;
};

// Row copy on `stream` of `device`, one kernel launch. With indices_on_device the plan's
// index pointers are device addresses (read by the kernel as they stand); otherwise they are
// host arrays: up to a few dozen rows travel inside the launch parameters, more are copied
// to a stream-ordered scratch buffer first. Returns once the work is queued.
std::string copy_rows(const CopyPlan& plan, bool indices_on_device, int device, std::uint64_t stream,
                      const RowCheck* check = nullptr);

std::string versions(int* runtime, int* driver);
std::string device_count(int* count);
// Enable peer access from `device` to `peer` (idempotent); *enabled=false where the
// hardware cannot (the caller decides whether that is an error).
std::string peer_access(int device, int peer, bool* enabled);

std::string stream_create(int device, std::uint64_t* stream);
std::string stream_destroy(std::uint64_t stream);
std::string stream_synchronize(std::uint64_t stream, int device = -1);

std::string event_create(int device, std::uint64_t* event);
std::string event_record(std::uint64_t event, std::uint64_t stream);
std::string event_query(std::uint64_t event, bool* done);  // done=false while pending
std::string event_synchronize(std::uint64_t event);
// Queries `event` in a loop for up to `timeout_us` microseconds (the caller's thread, no
// driver wake-up): done=true once it completed. For small copies, whose kernels end within
// microseconds of their launch.
std::string event_spin(std::uint64_t event, std::int64_t timeout_us, bool* done);

// A small copy's last step in one call: spin up to `spin_us` for `event`, and once it
// completed write `frame` (`len` bytes) to the non-blocking socket `fd` (fd < 0: no socket).
// *done: the event completed within the spin; *sent: bytes written (0 when not done, no
// socket, or the socket was full; -errno when the write failed). A CUDA failure is the
// returned message; a socket failure is only reported through *sent.
// With `check` (host bytes a checked copy wrote, `check_rows` of them), the frame goes only if
// every byte is 0: every row checked out.
std::string event_spin_send(std::uint64_t event, std::int64_t spin_us, int fd, const char* frame, std::size_t len,
                            bool* done, std::int64_t* sent, const unsigned char* check = nullptr,
                            std::size_t check_rows = 0);
std::string event_destroy(std::uint64_t event);

// Once the work queued on `stream` so far has completed, a driver thread writes one byte to
// file descriptor `fd` (cudaLaunchHostFunc): a sleeping progress thread wakes exactly then,
// without polling. The fd must stay open until the stream has drained.
std::string stream_signal_fd(std::uint64_t stream, int fd);

// Exports the allocation holding `ptr`: its handle, base and size (ptr - base is the offset
// the importer adds to its mapping).
std::string ipc_export(int device, std::uint64_t ptr, std::string* handle, std::uint64_t* base, std::uint64_t* size);
std::string ipc_open(int device, const std::string& handle, std::uint64_t* base);
std::string ipc_close(int device, std::uint64_t base);

// Page-locks host memory (a shared-memory file another process polls) and maps it for the
// device: *device_ptr is its address in kernels. Unregister before unmapping it.
std::string host_register(int device, std::uint64_t ptr, std::uint64_t bytes, std::uint64_t* device_ptr);
std::string host_unregister(int device, std::uint64_t ptr);
// Queues, on `stream`, one 8-byte store of `value` at `device_ptr` (device-visible memory,
// e.g. from host_register): it happens once the work queued before it has completed.
std::string stream_write_word(int device, std::uint64_t stream, std::uint64_t device_ptr, std::uint64_t value);

// A small transfer's whole launch in one call: copy_rows (host indices), then, if asked, the
// doorbell store (bell_ptr != 0) and the completion event (event != 0) behind it on the same
// stream. The returned message is the copy's failure (then nothing was queued); a failure of
// the store or of the event, after the copy was queued, goes to *bell_err / *event_err.
// With a check (`check` non-null, out != 0), a doorbell rings only from a small copy's own kernel,
// and only if every row checked out; otherwise none is stored.
std::string copy_rows_then(const CopyPlan& plan, int device, std::uint64_t stream, std::uint64_t bell_ptr,
                           std::uint64_t bell_value, std::uint64_t event, std::string* bell_err,
                           std::string* event_err, const RowCheck* check = nullptr);

// kvxfer's integrity digest with constant `k` of `rows` rows of `row_bytes` bytes at
// `base + slots[i] * stride` in device memory (cuda_digest.cu), into the host array `out` (one
// uint64 per row). `slots` is a host array. Runs on `stream` and returns once it has drained.
std::string row_digests(int device, std::uint64_t stream, std::uint64_t base, std::int64_t stride,
                        const std::int64_t* slots, std::int64_t rows, std::int64_t row_bytes, std::uint64_t k,
                        std::uint64_t* out);

// Plain device memory, for tests and tools that run without a framework.
std::string device_alloc(int device, std::uint64_t bytes, std::uint64_t* ptr);
std::string device_free(int device, std::uint64_t ptr);
std::string copy_bytes(int device, std::uint64_t dst, std::uint64_t src, std::uint64_t bytes);  // synchronous, any direction

}  // namespace kvxfer::cuda
