"""The CUDA surface poolloader uses, behind one interface.

`CudaRuntime` is every call the reuse gate and the stager make (devices with a
context, streams, events, host registration, error names); nothing else in poolloader
touches torch.cuda. `TorchCuda` implements it over torch.cuda and the libcudart torch
already loaded; the tests drive the same gate through a deterministic CPU stand-in
(tests/cuda_standin.py) passed as `loader._cuda_runtime`, since these machines have no GPU.
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Protocol

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _torch_pin_memory

# cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinning.
_HOST_REGISTER_PORTABLE = 1
# Bound on probing one priority level of torch's stream pool (it holds 32 per level).
_POOL_PROBE_MAX = 256

# CUDA runtime error names, for when libcudart cannot be asked (cuda_runtime_api.h).
_ERROR_NAMES = {
    0: "cudaSuccess", 1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError", 4: "cudaErrorCudartUnloading",
    100: "cudaErrorNoDevice", 101: "cudaErrorInvalidDevice", 304: "cudaErrorOperatingSystem",
    700: "cudaErrorIllegalAddress", 712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered", 801: "cudaErrorNotSupported",
    999: "cudaErrorUnknown",
}


class CudaRuntime(Protocol):
    """The CUDA surface poolloader uses; nothing else here touches torch.cuda.

    Streams and events are opaque to the callers. All calls come from the main
    process's iterating thread.
    """

    def devices_with_context(self) -> list[int]:
        """Devices on which this process has a CUDA context (none: no work can be queued)."""

    def streams(self, device: int) -> list[Any]:
        """Every stream of `device` that may have work queued and that this process can
        know of: its default stream, every stream of torch's pool handed out so far (to
        anyone), the calling thread's current stream, and the streams given to
        `watch_stream`. One call costs O(those streams), never O(torch's pool): a pool
        stream nobody took has nothing queued."""

    def current_stream(self, device: int) -> Any: ...

    def new_stream(self, device) -> Any: ...

    def stream_context(self, stream) -> Any:
        """A context manager making `stream` current."""

    def stream_idle(self, stream) -> bool:
        """True when everything queued on `stream` has completed."""

    def stream_wait(self, stream, event) -> None:
        """Make work queued later on `stream` wait for `event` (no host wait)."""

    def record_event(self, stream) -> Any:
        """A new event recorded on `stream` now."""

    def event_done(self, event) -> bool: ...

    def wait_events(self, events, timeout: float) -> bool:
        """Block until every event completed or `timeout` s passed; True if all did."""

    def copy_to(self, tensor: torch.Tensor, device) -> torch.Tensor:
        """A non-blocking copy of `tensor` to `device`, on the current stream."""

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that `stream` uses the device `tensor`."""

    def pin_tensor(self, tensor: torch.Tensor, device) -> torch.Tensor:
        """DataLoader's pinning of one tensor that is not slot memory."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether a CPU tensor's memory is page-locked (`tensor.is_pinned()`)."""

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        """A new page-locked uint8 CPU tensor of `nbytes` (a batch's small buffer)."""

    def host_register(self, address: int, size: int) -> int:
        """cudaHostRegister (portable); the CUDA error code, 0 on success."""

    def host_unregister(self, address: int) -> int:
        """cudaHostUnregister; the CUDA error code."""

    def clear_error(self) -> int | None:
        """cudaGetLastError: read and reset the thread's last error (None if unreadable)."""

    def error_name(self, code: int) -> str: ...


# ---------------------------------------------------------------------------
# the real runtime

def _loaded_cudart():
    """The libcudart torch already loaded, through ctypes (same instance, so the same
    last-error state); None when torch linked the runtime statically."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libcudart"):
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue
            lib.cudaGetLastError.restype = ctypes.c_int
            lib.cudaGetErrorName.restype = ctypes.c_char_p
            lib.cudaGetErrorName.argtypes = [ctypes.c_int]
            return lib
    return None


def _pool_index(stream) -> int:
    """A pool stream's index in its priority level: c10's StreamId keeps it above the
    type bits (c10/cuda/CUDAStream.cpp: index << (kStreamTypeBits + 1)). Checked once
    per level by _PoolWatch, which falls back to watching the whole pool if it is not."""
    return (stream.stream_id >> 5) & 31


class _PoolWatch:
    """Which streams of torch's stream pool on one device have been handed out.

    torch.cuda.Stream() (and C++ getStreamFromPool) hands out a priority level's
    streams round-robin from a per-process counter that starts at 0, so a stream
    this runtime takes itself tells where the counter is: every index between the
    one it took last time and the one it takes now went to someone else. At the
    first look every stream before the counter was handed out. A level costs one
    torch.cuda.Stream() per look (no CUDA call once the pool exists).

    Where this cannot be exact, it is conservative: if the index layout is not the
    one expected (another torch), every stream of the pool is watched, as before. If
    a level's 32 streams are taken 32 times or more between two looks (or before the
    first), the counter has wrapped and the look cannot see it: then, too, watch them
    (`poolloader.watch_stream`) or take one stream per role, as torch's pool note asks.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        default = torch.cuda.default_stream(device)
        self.taken: dict[int, Any] = {default.cuda_stream: default}
        self.levels: dict[int, tuple[list, int]] = {}  # priority -> (streams by index, next index)
        least, greatest = default.priority_range()
        for priority in range(least, greatest - 1, -1):
            level = self._level(priority)
            if level is None:
                continue
            by_index, first = level
            for i in range(first):  # handed out before this runtime looked
                self._take(by_index[i])
            # our probes went round once and took `first` again: the counter is one past it
            self.levels[priority] = (by_index, (first + 1) % len(by_index))

    def _level(self, priority: int) -> tuple[list, int] | None:
        """(the level's streams by index, the index the counter was at), or None after
        watching all of them (layout not as expected)."""
        found: dict[int, Any] = {}
        order = []
        for _ in range(_POOL_PROBE_MAX):
            stream = self._probe(priority)
            if stream.cuda_stream in found:
                break
            found[stream.cuda_stream] = stream
            order.append(_pool_index(stream))
        n = len(order)
        if sorted(order) != list(range(n)) or any(
                order[k] != (order[0] + k) % n for k in range(n)):
            for stream in found.values():
                self._take(stream)
            return None
        by_index: list = [None] * n
        for stream in found.values():
            by_index[_pool_index(stream)] = stream
        return by_index, order[0]

    def _take(self, stream) -> None:
        self.taken[stream.cuda_stream] = stream

    def _probe(self, priority: int):
        if torch.cuda.current_device() == self.device:
            return torch.cuda.Stream(priority=priority)  # no device switch: the cheap path
        return torch.cuda.Stream(device=self.device, priority=priority)

    def look(self) -> None:
        """Note every stream handed out since the last look."""
        for priority, (by_index, expected) in self.levels.items():
            got = _pool_index(self._probe(priority))
            n = len(by_index)
            i = expected
            while i != got:
                self._take(by_index[i])
                i = (i + 1) % n
            self.levels[priority] = (by_index, (got + 1) % n)


_watched: dict[int, Any] = {}  # watch_stream(): cuda_stream -> stream


def watch_stream(stream) -> None:
    """Have every pool of this process hold a released slot until the work queued on
    `stream` before the release has finished: for a stream torch did not hand out
    (`torch.cuda.ExternalStream`, another library's) on which batches are copied.
    For the rest of the process (one query per release each); main process only."""
    _watched[stream.cuda_stream] = stream


class TorchCuda:
    """CudaRuntime over torch.cuda and torch.cuda.cudart(); one per process (`torch_runtime()`).

    A marker costs, per device with a context, one look at torch's stream pool
    (_PoolWatch: a torch.cuda.Stream() per priority level), one cudaStreamQuery per
    stream that may have work (the default stream, the pool streams handed out so
    far, the current stream, watched ones) and one event per busy one.
    """

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()
        self._pools: dict[int, _PoolWatch] = {}
        self._lib = _loaded_cudart()
        self._has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)

    def devices_with_context(self) -> list[int]:
        if not torch.cuda.is_initialized():
            return []
        n = torch.cuda.device_count()
        if self._has_context is None:
            return list(range(n))
        return [d for d in range(n) if self._has_context(d)]

    def streams(self, device: int) -> list:
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = _PoolWatch(device)
        else:
            pool.look()
        taken = pool.taken
        current = torch.cuda.current_stream(device)
        listed = list(taken.values())
        if current.cuda_stream not in taken:
            listed.append(current)  # an ExternalStream made current
        for key, stream in _watched.items():
            if key not in taken and key != current.cuda_stream and stream.device.index == device:
                listed.append(stream)
        return listed

    def current_stream(self, device: int):
        return torch.cuda.current_stream(device)

    def new_stream(self, device):
        return torch.cuda.Stream(device=device)

    def stream_context(self, stream):
        return torch.cuda.stream(stream)

    def stream_idle(self, stream) -> bool:
        return stream.query()

    def stream_wait(self, stream, event) -> None:
        stream.wait_event(event)

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def event_done(self, event) -> bool:
        return event.query()

    def wait_events(self, events, timeout: float) -> bool:
        # cudaEventSynchronize cannot time out: poll, backing off to 2 ms.
        deadline = time.monotonic() + timeout
        pending = [e for e in events if not e.query()]
        pause = 20e-6
        while pending:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
            pending = [e for e in pending if not e.query()]
        return True

    def copy_to(self, tensor, device):
        return tensor.to(device, non_blocking=True)

    def record_stream(self, tensor, stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def pin_tensor(self, tensor, device):
        return _torch_pin_memory(tensor, device)

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def empty_pinned(self, nbytes: int):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_register(self, address: int, size: int) -> int:
        return int(self._cudart.cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE))

    def host_unregister(self, address: int) -> int:
        return int(self._cudart.cudaHostUnregister(address))

    def clear_error(self) -> int | None:
        if self._lib is not None:
            return int(self._lib.cudaGetLastError())
        # torch linked cudart statically: a kernel launch's own check reads (and so
        # clears) the last error; it raises it, which is what we expect here.
        try:
            torch.cuda._sleep(0)
        except RuntimeError:
            pass
        return None

    def error_name(self, code: int) -> str:
        if self._lib is not None:
            name = self._lib.cudaGetErrorName(code)
            if name:
                return name.decode()
        return _ERROR_NAMES.get(code, f"cudaError {code}")


_torch_cuda: TorchCuda | None = None


def torch_runtime() -> TorchCuda:
    global _torch_cuda
    if _torch_cuda is None:
        _torch_cuda = TorchCuda()
    return _torch_cuda
