"""Batched row copy: the compiled ``kvxfer._native`` when present, else numpy / torch.

One operation covers every case: rows move from ``src_base + src_slots[i] * src_stride`` to
``dst_base + dst_slots[i] * dst_stride``; ``slots=None`` means a contiguous buffer (row i at
``base + i * stride``), so gather (rows -> buffer) and scatter (buffer -> rows) are the same
call. HOST memory is copied by multi-threaded memcpy (or numpy); DEVICE memory by one CUDA
kernel queued on the caller's stream (or torch ``index_select``/``index_copy_``). Both paths
give identical bytes when no destination slot is named twice. A repeated destination slot gets
one of its rows, which one unspecified (threads and GPU blocks write rows concurrently), and
overlapping source and destination rows are undefined: callers pass distinct destinations, as
the backends do (a fetch's rows are checked distinct before any copy).

``transform_copy`` moves KV between two paged layouts (NHD, HND, head slices, other block
sizes): segments of tokens, each (token, head) unit copied from ``src + t * token_stride +
h * head_stride`` to the same expression on the destination end; natively by memcpy runs or
one CUDA kernel, else numpy / torch indexing with identical bytes.

``row_digests`` reads host rows where they lie (no gather) and returns each one's integrity
digest (``kvxfer.backends.common.integrity`` defines it and keeps the numpy fallback);
``segment_digests`` the shares of destination rows of an engine geometry that segments of units
add (``kvxfer.backends.common.plan_digest``).

``info()`` says what is available and why not. Failures raise :class:`RowCopyError`.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import operator
import os
import select
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvxfer.contract import KvxferError, MemoryKind

Impl = Literal["auto", "native", "fallback"]


class RowCopyError(KvxferError):
    """A row copy was refused (bad geometry, index out of range) or failed (CUDA's text included)."""


@dataclass(frozen=True)
class DeviceIndex:
    """An int64 slot index array already in device memory: its address (read as it stands)."""

    ptr: int


@dataclass(frozen=True)
class NativeInfo:
    """What this process can use. ``reason`` says why the compiled module or CUDA is missing."""

    compiled: bool
    cuda_built: bool
    cuda_usable: bool
    device_count: int
    cuda_runtime: int
    cuda_driver: int
    module_path: str
    reason: str
    transform: bool = False  # the compiled module has the layout transform (host, and CUDA where built)
    digest: bool = False  # the compiled module has the host row digest (row_digests)

    @property
    def host(self) -> bool:
        return True  # the numpy fallback always exists

    @property
    def cuda_transform(self) -> bool:
        """``transform_copy`` over DEVICE memory runs the native kernel (else the torch fallback)."""
        return self.transform and self.cuda_usable


def _load() -> tuple[ModuleType | None, str]:
    try:
        from kvxfer import _native  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"kvxfer._native is not built ({exc}); using the numpy/torch fallback"
    return _native, ""


_NATIVE, _LOAD_REASON = _load()
if _NATIVE is not None and hasattr(_NATIVE, "stop_fill_helpers"):
    # Large CUDA copies fill their index staging with persistent native helper threads.
    atexit.register(_NATIVE.stop_fill_helpers)


def spin_poll(fds: list[int], timeout_s: float, words: np.ndarray | None = None,
              slots: np.ndarray | None = None) -> bool:
    """Wait up to ``timeout_s`` for input on ``fds`` without sleeping (a busy core instead of
    a thread wake-up): True once one has input, or once a word ``words[slots[i]]`` is
    non-zero (``words``: uint64, e.g. shared memory a GPU writes). Native with the GIL
    released; else a Python loop of zero-timeout polls that yields the GIL between them."""
    watched = slots is not None and slots.size > 0
    if watched:
        assert words is not None and words.dtype == np.uint64 and slots is not None and slots.dtype == np.int64
        if not words.flags.c_contiguous:  # the native spin reads words at base + 8 * slot
            raise ValueError("spin_poll: words must be a contiguous array")
        if int(slots.min()) < 0 or int(slots.max()) >= words.size:
            raise ValueError(f"spin_poll: slots must lie in [0, {words.size})")
    if _NATIVE is not None and hasattr(_NATIVE, "spin_poll"):
        if not watched:
            return bool(_NATIVE.spin_poll(fds, max(0, int(timeout_s * 1e6))))
        assert words is not None
        return bool(_NATIVE.spin_poll(fds, max(0, int(timeout_s * 1e6)), words.ctypes.data,
                                      np.ascontiguousarray(slots)))
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    end = time.perf_counter() + timeout_s
    while not poller.poll(0):
        if watched and words is not None and words[slots].any():
            return True
        if time.perf_counter() >= end:
            return False
        os.sched_yield()
    return True


def cuda_built() -> bool:
    """The module has its CUDA half, asked without starting CUDA here (``info()`` starts it)."""
    return bool(getattr(_NATIVE, "HAS_CUDA", False))


@functools.lru_cache(maxsize=1)
def info() -> NativeInfo:
    mod = _NATIVE
    if mod is None:
        return NativeInfo(False, False, False, 0, 0, 0, "", _LOAD_REASON)
    path = str(getattr(mod, "__file__", ""))
    transform = bool(getattr(mod, "HAS_TRANSFORM", False))
    digest = bool(getattr(mod, "HAS_DIGEST", False))
    if not mod.HAS_CUDA:
        return NativeInfo(True, False, False, 0, 0, 0, path,
                          "kvxfer._native was built without CUDA (no nvcc found, or KVXFER_CUDA=OFF)", transform,
                          digest)
    try:
        runtime, driver = mod.versions()
        count = mod.device_count()
    except mod.CopyError as exc:
        return NativeInfo(True, True, False, 0, 0, 0, path, f"CUDA is not usable here: {exc}", transform, digest)
    reason = "" if count > 0 else "no CUDA device is visible"
    return NativeInfo(True, True, count > 0, count, runtime, driver, path, reason, transform, digest)


def cuda_module() -> ModuleType:
    """The compiled module with its CUDA half usable, or RowCopyError naming why not."""
    state = info()
    if not state.cuda_usable or _NATIVE is None:
        raise RowCopyError(state.reason or "kvxfer._native has no usable CUDA")
    return _NATIVE


# --- checks shared by both paths ------------------------------------------------------
Slots = npt.NDArray[np.int64] | DeviceIndex | None


def _host_slots(slots: Any, n_rows: int | None, what: str) -> tuple[npt.NDArray[np.int64] | DeviceIndex | None, int | None]:
    if slots is None or isinstance(slots, DeviceIndex):
        return slots, n_rows
    array = np.asarray(slots)
    if array.dtype != np.int64 or array.ndim != 1:
        raise RowCopyError(f"{what} slots must be a one-dimensional int64 array, got {array.dtype} {array.shape}")
    array = np.ascontiguousarray(array)
    if n_rows is not None and array.size != n_rows:
        raise RowCopyError(f"{what} slots hold {array.size} rows, the other end {n_rows}")
    return array, int(array.size)


_INT64_MAX = (1 << 63) - 1


def _check_range(slots: Any, limit: int | None, n: int, stride: int, row_bytes: int, what: str) -> None:
    """Every row of an end lies in [0, limit) (when a limit is given), no slot is negative,
    and the furthest byte's address does not wrap around int64 (index * stride)."""
    if isinstance(slots, DeviceIndex):
        if limit is not None:
            raise RowCopyError(f"a {what} limit cannot be checked against device-resident indices (DeviceIndex): "
                               "check them where they are made")
        return
    if n == 0 or row_bytes == 0:
        return
    if slots is None:  # row i is slot i
        high = n - 1
        if limit is not None and n > limit:
            raise RowCopyError(f"{what} rows 0..{high} do not fit its {limit} slots")
    else:
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or (limit is not None and high >= limit):
            bad = low if low < 0 else high
            raise RowCopyError(f"{what} index {bad} is outside [0, {limit if limit is not None else 'inf'})")
    if high * stride + row_bytes > _INT64_MAX:
        raise RowCopyError(f"{what} index {high} at stride {stride} lies past the end of the address space")


def copy_rows(
    *,
    src_base: int, src_stride: int, src_slots: Slots,
    dst_base: int, dst_stride: int, dst_slots: Slots,
    row_bytes: int, n_rows: int | None = None,
    memory: MemoryKind = MemoryKind.HOST,
    stream: int = 0, device: int = -1,
    src_limit: int | None = None, dst_limit: int | None = None,
    threads: int = 0, impl: Impl = "auto",
) -> None:
    """Copy rows between two (base, stride, slots) spaces; see the module docstring.

    HOST: returns when the bytes are in place. DEVICE: returns once queued on ``stream``
    (an integer ``cudaStream_t``); the copy is done when work queued after it is.
    ``*_limit`` bounds the slot numbers (a region's slot count); out of range is refused.
    """
    src, n = _host_slots(src_slots, n_rows, "source")
    dst, n = _host_slots(dst_slots, n, "destination")
    if n is None:
        raise RowCopyError("n_rows is needed when neither end has a host slot array")
    _check_geometry(n, row_bytes, src_base, src_stride, dst_base, dst_stride)
    _check_range(src, src_limit, n, src_stride, row_bytes, "source")
    _check_range(dst, dst_limit, n, dst_stride, row_bytes, "destination")
    if n == 0 or row_bytes == 0:
        return
    if impl not in ("auto", "native", "fallback"):
        raise RowCopyError(f"impl must be auto, native or fallback, got {impl!r}")
    if memory is MemoryKind.HOST:
        _copy_host(src_base, src_stride, src, dst_base, dst_stride, dst, n, row_bytes, threads, impl)
    else:
        _copy_device(src_base, src_stride, src, dst_base, dst_stride, dst, n, row_bytes, stream, device, impl)


def _check_geometry(n: int, row_bytes: int, src_base: int, src_stride: int, dst_base: int, dst_stride: int) -> None:
    """No negative size; where anything moves, a row fits each end's stride and no base is null."""
    if n < 0 or row_bytes < 0 or src_stride < 0 or dst_stride < 0:
        raise RowCopyError("n_rows, row_bytes and strides must not be negative")
    if n == 0 or row_bytes == 0:
        return
    if row_bytes > src_stride or row_bytes > dst_stride:
        raise RowCopyError(f"row_bytes {row_bytes} exceeds a stride (source {src_stride}, destination {dst_stride})")
    if src_base == 0 or dst_base == 0:
        raise RowCopyError("a base address is null")


def _copy_host(src_base: int, src_stride: int, src: Any, dst_base: int, dst_stride: int, dst: Any,
               n: int, row_bytes: int, threads: int, impl: Impl) -> None:
    """Checked rows between host addresses: multi-threaded memcpy, else numpy."""
    if isinstance(src, DeviceIndex) or isinstance(dst, DeviceIndex):
        raise RowCopyError("host copies take host slot arrays, not DeviceIndex")
    if impl != "fallback" and _NATIVE is not None:
        _native_call(_NATIVE.host_copy_rows, src_base, src_stride, src, dst_base, dst_stride, dst, n, row_bytes,
                     threads)
        return
    if impl == "native":
        raise RowCopyError(_LOAD_REASON)
    _numpy_copy(src_base, src_stride, src, dst_base, dst_stride, dst, n, row_bytes)


def _copy_device(src_base: int, src_stride: int, src: Any, dst_base: int, dst_stride: int, dst: Any,
                 n: int, row_bytes: int, stream: int, device: int, impl: Impl) -> None:
    """Checked rows between device addresses: one CUDA kernel queued on ``stream``, else torch."""
    if impl != "fallback" and info().cuda_usable and _NATIVE is not None:
        if isinstance(src, DeviceIndex) or isinstance(dst, DeviceIndex):
            _native_call(_NATIVE.cuda_copy_rows_device, src_base, src_stride, _device_ptr(src), dst_base, dst_stride,
                         _device_ptr(dst), n, row_bytes, stream, device)
        else:
            _native_call(_NATIVE.cuda_copy_rows, src_base, src_stride, src, dst_base, dst_stride, dst, n, row_bytes,
                         stream, device)
        return
    if impl == "native":
        raise RowCopyError(info().reason or "kvxfer._native has no usable CUDA")
    _torch_copy(src_base, src_stride, src, dst_base, dst_stride, dst, n, row_bytes, stream, device)


def gather_rows(*, src_base: int, src_stride: int, src_slots: Slots, dst_base: int, row_bytes: int,
                **kw: Any) -> None:
    """Rows of a slot space into a contiguous buffer (row i at ``dst_base + i * row_bytes``)."""
    copy_rows(src_base=src_base, src_stride=src_stride, src_slots=src_slots, dst_base=dst_base,
              dst_stride=row_bytes, dst_slots=None, row_bytes=row_bytes, **kw)


def scatter_rows(*, src_base: int, dst_base: int, dst_stride: int, dst_slots: Slots, row_bytes: int,
                 **kw: Any) -> None:
    """A contiguous buffer (row i at ``src_base + i * row_bytes``) into rows of a slot space."""
    copy_rows(src_base=src_base, src_stride=row_bytes, src_slots=None, dst_base=dst_base,
              dst_stride=dst_stride, dst_slots=dst_slots, row_bytes=row_bytes, **kw)


def _native_call(fn: Any, *args: Any) -> None:
    assert _NATIVE is not None
    try:
        fn(*args)
    except _NATIVE.CopyError as exc:
        raise RowCopyError(str(exc)) from exc


def _device_ptr(slots: Any) -> int:
    if isinstance(slots, DeviceIndex):
        return slots.ptr
    raise RowCopyError("mixing a DeviceIndex with a host slot array or None is not supported; upload both")


# --- fallbacks ----------------------------------------------------------------------
def _extent(slots: Any, n: int, stride: int, row_bytes: int) -> int:
    last = (int(slots.max()) if isinstance(slots, np.ndarray) else n - 1)
    return last * stride + row_bytes


def _host_rows(base: int, stride: int, extent: int, row_bytes: int) -> npt.NDArray[np.uint8]:
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * extent).from_address(base))
    rows = (extent - row_bytes) // stride + 1 if stride else 1
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, row_bytes), strides=(stride, 1))


def _numpy_copy(src_base: int, src_stride: int, src: Any, dst_base: int, dst_stride: int, dst: Any,
                n: int, row_bytes: int) -> None:
    src_rows = _host_rows(src_base, src_stride, _extent(src, n, src_stride, row_bytes), row_bytes)
    dst_rows = _host_rows(dst_base, dst_stride, _extent(dst, n, dst_stride, row_bytes), row_bytes)
    src_ix = src if src is not None else np.arange(n, dtype=np.int64)
    dst_ix = dst if dst is not None else np.arange(n, dtype=np.int64)
    dst_rows[dst_ix] = src_rows[src_ix]


class _CudaSpan:
    """Wraps a device address range for torch.as_tensor (no copy)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }


def _torch_copy(src_base: int, src_stride: int, src: Any, dst_base: int, dst_stride: int, dst: Any,
                n: int, row_bytes: int, stream: int, device: int) -> None:
    try:
        import torch
    except ImportError as exc:
        raise RowCopyError(f"device copy needs kvxfer._native with CUDA or torch: {exc}") from exc
    if not torch.cuda.is_available():
        raise RowCopyError(f"no CUDA device for a device copy ({info().reason or 'torch sees none'})")
    dev = torch.device("cuda", device if device >= 0 else torch.cuda.current_device())
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dev)):

        def rows(base: int, stride: int, slots: Any) -> Any:
            extent = _extent(slots, n, stride, row_bytes) if not isinstance(slots, DeviceIndex) else None
            if extent is None:
                raise RowCopyError("the torch fallback needs host slot arrays (or kvxfer._native for DeviceIndex)")
            flat = torch.as_tensor(_CudaSpan(base, extent), device=dev)
            count = (extent - row_bytes) // stride + 1
            return flat.as_strided((count, row_bytes), (stride, 1))

        def index(slots: Any) -> Any:
            host = slots if slots is not None else np.arange(n, dtype=np.int64)
            return torch.from_numpy(host).to(dev, non_blocking=False)

        src_rows, dst_rows = rows(src_base, src_stride, src), rows(dst_base, dst_stride, dst)
        picked = src_rows.index_select(0, index(src))
        dst_rows.index_copy_(0, index(dst), picked)


# --- row digest -------------------------------------------------------------------------
def row_digests(*, base: int, stride: int, slots: npt.NDArray[np.int64], row_bytes: int, k: int,
                threads: int = 0) -> npt.NDArray[np.uint64]:
    """The integrity digest with constant ``k`` of the ``row_bytes`` bytes at ``base + slots[i] *
    stride`` (host memory), one uint64 per slot, read in place by the compiled module with the
    GIL released (``threads`` as in ``copy_rows``). RowCopyError where the module lacks it
    (``info().digest``: the caller then uses its numpy definition) or a slot is negative. No
    upper bound is checked: the caller's rows must be mapped."""
    if not info().digest or _NATIVE is None:
        raise RowCopyError(_LOAD_REASON or "kvxfer._native was built without the row digest")
    index, n = _host_slots(slots, None, "digest")
    assert isinstance(index, np.ndarray) and n is not None
    try:
        out: npt.NDArray[np.uint64] = _NATIVE.host_row_digests(base, stride, index, n, row_bytes, k, threads)
    except _NATIVE.CopyError as exc:
        raise RowCopyError(str(exc)) from exc
    return out


def segment_digests(addr: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], offset: npt.NDArray[np.int64],
                    row_bytes: npt.NDArray[np.int64], *, heads: int, unit_bytes: int, strides: tuple[int, int],
                    canon: tuple[int, int], k: int, threads: int = 0) -> npt.NDArray[np.uint64]:
    """Each segment's share of the digest of the destination row it lands in (native/digest.h:
    units read at ``addr[s] + t * strides[0] + h * strides[1]``, placed at byte ``offset[s] +
    t * canon[0] + h * canon[1]`` of a row of ``row_bytes[s]``); host memory, in place, the GIL
    released. RowCopyError where the module lacks it (``has_segment_digests()``) or a segment
    does not fit its row."""
    if not has_segment_digests() or _NATIVE is None:
        raise RowCopyError(_LOAD_REASON or "kvxfer._native was built without the segment digest")
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (addr, tokens, offset, row_bytes)]
    try:
        out: npt.NDArray[np.uint64] = _NATIVE.host_segment_digests(*arrays, heads, unit_bytes, *strides, *canon, k,
                                                                   threads)
    except _NATIVE.CopyError as exc:
        raise RowCopyError(str(exc)) from exc
    return out


def has_segment_digests() -> bool:
    return bool(getattr(_NATIVE, "HAS_SEGMENT_DIGEST", False))


def has_device_digests() -> bool:
    """``device_row_digests`` runs here: the module has the CUDA digest and CUDA is usable."""
    return bool(getattr(_NATIVE, "HAS_CUDA_DIGEST", False)) and info().cuda_usable


def device_row_digests(*, base: int, stride: int, slots: npt.NDArray[np.int64], row_bytes: int, k: int,
                       device: int, stream: int = 0) -> npt.NDArray[np.uint64]:
    """``row_digests`` of rows in device memory (native/cuda_digest.cu): a kernel on ``stream``,
    drained before it returns, the GIL released; RowCopyError where it cannot run or CUDA fails."""
    if not has_device_digests() or _NATIVE is None:
        raise RowCopyError(_LOAD_REASON or info().reason or "kvxfer._native was built without the CUDA row digest")
    index, n = _host_slots(slots, None, "digest")
    if not isinstance(index, np.ndarray) or (n and int(index.min()) < 0):
        raise RowCopyError(f"digest slots must be a host array of slots, none negative, got {slots!r:.80}")
    try:
        out: npt.NDArray[np.uint64] = _NATIVE.cuda_row_digests(device, stream, base, stride, index, row_bytes, k)
    except _NATIVE.CopyError as exc:
        raise RowCopyError(str(exc)) from exc
    return out


# --- layout transform ---------------------------------------------------------------
Strides = tuple[int, int]  # (token stride, head stride) in bytes


def transform_copy(
    src_addr: Any, dst_addr: Any, tokens: Any, *,
    heads: int, unit_bytes: int, src_strides: Strides, dst_strides: Strides,
    memory: MemoryKind = MemoryKind.HOST, device: int = -1, stream: int = 0,
    threads: int = 0, impl: Impl = "auto",
) -> None:
    """Copy KV between two paged layouts, segment by segment.

    For every segment i, token t < ``tokens[i]`` and head h < ``heads``, ``unit_bytes``
    (head_dim * element size) go from ``src_addr[i] + t * src_strides[0] + h * src_strides[1]``
    to ``dst_addr[i] + t * dst_strides[0] + h * dst_strides[1]``. Addresses and token counts are
    integer arrays of one entry per segment (int64 avoids a conversion). NHD blocks have strides
    ``(heads_held * unit_bytes, unit_bytes)``, HND blocks ``(unit_bytes, block_tokens * unit_bytes)``;
    a head slice starts its segment's address at its first head.

    HOST: returns when the bytes are in place (``threads`` as in ``copy_rows``). DEVICE:
    returns once queued on ``stream`` (an integer ``cudaStream_t``) of ``device`` (-1: the
    current one), as ``copy_rows`` does. Anything wrong is refused with RowCopyError before
    a byte moves. Overlapping destinations (two segments, or source and destination) are
    undefined, as for rows.
    """
    src, dst, tok = _segment_arrays(src_addr, dst_addr, tokens)
    geometry = _transform_geometry(heads, unit_bytes, src_strides, dst_strides)
    if impl not in ("auto", "native", "fallback"):
        raise RowCopyError(f"impl must be auto, native or fallback, got {impl!r}")
    if memory is MemoryKind.HOST:
        if impl != "fallback" and info().transform:
            _native_call(_NATIVE.host_transform_copy, src, dst, tok, *geometry, threads)  # type: ignore[union-attr]
            return
        if impl == "native":
            raise RowCopyError(_LOAD_REASON or "kvxfer._native was built without the layout transform")
        _check_segments(src, dst, tok, *geometry)
        _numpy_transform(src, dst, tok, *geometry)
        return
    if impl != "fallback" and info().cuda_transform:
        _native_call(_NATIVE.cuda_transform_copy, src, dst, tok, *geometry, stream, device)  # type: ignore[union-attr]
        return
    if impl == "native":
        raise RowCopyError(info().reason or "kvxfer._native was built without the layout transform")
    _check_segments(src, dst, tok, *geometry)
    _torch_transform(src, dst, tok, *geometry, stream, device)


def _segment_arrays(*arrays: Any) -> tuple[npt.NDArray[np.int64], ...]:
    out = []
    for name, value in zip(("src_addr", "dst_addr", "tokens"), arrays):
        array = np.asarray(value)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise RowCopyError(f"{name} must be a one-dimensional integer array, got {array.dtype} {array.shape}")
        out.append(np.ascontiguousarray(array, dtype=np.int64))
    if not out[0].size == out[1].size == out[2].size:
        raise RowCopyError("src_addr, dst_addr and tokens must have one entry per segment; got "
                           f"{out[0].size}, {out[1].size} and {out[2].size}")
    return tuple(out)


def _transform_geometry(heads: Any, unit_bytes: Any, src_strides: Any, dst_strides: Any) -> tuple[int, ...]:
    """(heads, unit_bytes, src token stride, src head stride, dst token stride, dst head stride)."""
    try:
        values = [int(operator.index(heads)), int(operator.index(unit_bytes))]
        for name, pair in (("src_strides", src_strides), ("dst_strides", dst_strides)):
            if len(pair) != 2:
                raise RowCopyError(f"{name} must be (token stride, head stride), got {pair!r}")
            values += [int(operator.index(v)) for v in pair]
    except TypeError as exc:
        raise RowCopyError(f"heads, unit_bytes and strides must be integers: {exc}") from exc
    names = ("heads", "unit_bytes", "src_token_stride", "src_head_stride", "dst_token_stride", "dst_head_stride")
    for name, value, low in zip(names, values, (1, 1, 0, 0, 0, 0)):
        if value < low:  # the native check's words, so that both paths read alike
            raise RowCopyError(f"{name} must be at least 1, got {value}" if low else f"{name} is negative ({value})")
        if value > _INT64_MAX:
            raise RowCopyError(f"{name} {value} does not fit in int64")
    return tuple(values)


def _check_segments(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64], tok: npt.NDArray[np.int64],
                    heads: int, unit: int, sts: int, shs: int, dts: int, dhs: int) -> None:
    """What the native check_transform refuses, for the fallbacks."""
    first = np.flatnonzero(tok < 0)
    if first.size:
        raise RowCopyError(f"tokens[{first[0]}] = {tok[first[0]]} is negative")
    if heads > 1 and dhs < unit:
        raise RowCopyError(f"destination heads overlap: dst_head_stride {dhs} < unit_bytes {unit}")
    first = np.flatnonzero(tok > 1)
    if first.size and dts < unit:
        raise RowCopyError(f"destination tokens overlap: dst_token_stride {dts} < unit_bytes {unit} "
                           f"(segment {first[0]})")
    moving = tok > 0
    for name, addr, ts, hs in (("src_addr", src, sts, shs), ("dst_addr", dst, dts, dhs)):
        first = np.flatnonzero(moving & (addr <= 0))
        if first.size:
            raise RowCopyError(f"{name}[{first[0]}] = {addr[first[0]]} is not an address")
        if not moving.any():
            continue
        # Bounded by the largest address and count first; each segment exactly only if that fails.
        if int(addr[moving].max()) + (int(tok.max()) - 1) * ts + (heads - 1) * hs + unit > _INT64_MAX:
            for i in np.flatnonzero(moving).tolist():
                if int(addr[i]) + (int(tok[i]) - 1) * ts + (heads - 1) * hs + unit > _INT64_MAX:
                    end = "source" if name == "src_addr" else "destination"
                    raise RowCopyError(f"segment {i}'s {end} runs past the end of the address space")


def _unit_elements(addr: npt.NDArray[np.int64], tok: npt.NDArray[np.int64], heads: int, unit: int,
                   token_stride: int, head_stride: int, elem: int) -> npt.NDArray[np.int64]:
    """The address of every `elem`-byte element copied at one end, in (segment, token, head,
    element) order: the same order on both ends pairs them up."""
    moving = tok > 0
    base, counts = addr[moving], tok[moving]
    first_token = np.repeat(np.cumsum(counts) - counts, counts)
    t = np.arange(int(counts.sum()), dtype=np.int64) - first_token
    units = (np.repeat(base, counts) + t * token_stride)[:, None] + np.arange(heads, dtype=np.int64) * head_stride
    return (units[..., None] + np.arange(0, unit, elem, dtype=np.int64)).ravel()


def _element_bytes(src: Any, dst: Any, tok: Any, heads: int, unit: int, sts: int, shs: int, dts: int,
                   dhs: int) -> int:
    """The widest of 8, 4, 2, 1 that every moving address, used stride and unit_bytes allows."""
    moving = tok > 0
    acc = unit | (shs | dhs if heads > 1 else 0) | (sts | dts if bool((tok > 1).any()) else 0)
    if moving.any():
        acc |= int(np.bitwise_or.reduce(src[moving])) | int(np.bitwise_or.reduce(dst[moving]))
    return next(w for w in (8, 4, 2, 1) if acc % w == 0)


def _transform_plan(src: Any, dst: Any, tok: Any, heads: int, unit: int, sts: int, shs: int, dts: int,
                    dhs: int) -> tuple[int, tuple[int, int, Any], tuple[int, int, Any]] | None:
    """(element bytes, (low address, extent, element indices) of each end); None: nothing moves."""
    if not (tok > 0).any():
        return None
    elem = _element_bytes(src, dst, tok, heads, unit, sts, shs, dts, dhs)
    ends = []
    for addr, ts, hs in ((src, sts, shs), (dst, dts, dhs)):
        at = _unit_elements(addr, tok, heads, unit, ts, hs, elem)
        low = int(at.min())
        ends.append((low, int(at.max()) + elem - low, (at - low) // elem))
    return elem, ends[0], ends[1]


def _numpy_transform(src: Any, dst: Any, tok: Any, *geometry: int) -> None:
    plan = _transform_plan(src, dst, tok, *geometry)
    if plan is None:
        return
    elem, (s_low, s_extent, s_ix), (d_low, d_extent, d_ix) = plan
    dtype = np.dtype(f"u{elem}")
    s_flat = np.ctypeslib.as_array((ctypes.c_uint8 * s_extent).from_address(s_low)).view(dtype)
    d_flat = np.ctypeslib.as_array((ctypes.c_uint8 * d_extent).from_address(d_low)).view(dtype)
    d_flat[d_ix] = s_flat[s_ix]


def _torch_transform(src: Any, dst: Any, tok: Any, heads: int, unit: int, sts: int, shs: int, dts: int, dhs: int,
                     stream: int, device: int) -> None:
    try:
        import torch
    except ImportError as exc:
        raise RowCopyError(f"a device transform needs kvxfer._native with CUDA or torch: {exc}") from exc
    if not torch.cuda.is_available():
        raise RowCopyError(f"no CUDA device for a device transform ({info().reason or 'torch sees none'})")
    plan = _transform_plan(src, dst, tok, heads, unit, sts, shs, dts, dhs)
    if plan is None:
        return
    elem, (s_low, s_extent, s_ix), (d_low, d_extent, d_ix) = plan
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[elem]
    dev = torch.device("cuda", device if device >= 0 else torch.cuda.current_device())
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dev)):
        s_flat = torch.as_tensor(_CudaSpan(s_low, s_extent), device=dev).view(dtype)
        d_flat = torch.as_tensor(_CudaSpan(d_low, d_extent), device=dev).view(dtype)
        picked = s_flat.index_select(0, torch.from_numpy(s_ix).to(dev))
        d_flat.index_copy_(0, torch.from_numpy(d_ix).to(dev), picked)
