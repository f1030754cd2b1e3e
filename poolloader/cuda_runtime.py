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
        """Every stream of `device` a copy could be queued on that torch knows: its
        default stream, its stream pool, the calling thread's current stream."""

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


def _torch_pool_streams(device: int) -> list:
    """The default stream and every stream of torch's pool on `device`.

    torch.cuda.Stream() hands out pool streams round-robin, per priority level, so
    asking until one repeats lists a level whole whatever its size; the counter ends
    one step further, which only shifts which pool stream the next caller gets.
    """
    found = {}
    default = torch.cuda.default_stream(device)
    found[default.cuda_stream] = default
    least, greatest = default.priority_range()
    for priority in range(least, greatest - 1, -1):
        for _ in range(_POOL_PROBE_MAX):
            stream = torch.cuda.Stream(device=device, priority=priority)
            if stream.cuda_stream in found:
                break
            found[stream.cuda_stream] = stream
    return list(found.values())


class TorchCuda:
    """CudaRuntime over torch.cuda and torch.cuda.cudart(); one per process (`torch_runtime()`).

    A marker costs one cudaStreamQuery per known stream per device with a context
    (the default stream and torch's pool: 1 + 32 per priority level) and one event
    per busy stream.
    """

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()
        self._known: dict[int, tuple[list, set]] = {}
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
        known = self._known.get(device)
        if known is None:
            pool = _torch_pool_streams(device)
            known = self._known[device] = (pool, {s.cuda_stream for s in pool})
        current = torch.cuda.current_stream(device)
        if current.cuda_stream in known[1]:
            return known[0]
        return known[0] + [current]  # an ExternalStream made current

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
