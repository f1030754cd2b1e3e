"""A deterministic CPU stand-in for the CUDA surface poolloader uses (poolloader.cuda.runtime.CudaRuntime).

The one test double this project allows: these machines have no GPU. It models
what the gate's correctness depends on, and nothing else:

* devices, each with a context once something used it (a stream, a registration
  while it was current);
* streams: FIFO queues of operations that run only when the test runs them or when
  the host waits on an event (a GPU makes progress while the host blocks). A
  "hung" stream never runs;
* events: recorded at a position of a stream's queue, complete once the stream ran
  past it; `stream_wait` queues a dependency on another stream's event;
* host-to-device copies: `copy(tensor, stream)` returns a CPU tensor standing for
  the device copy. From registered memory the copy is queued and reads the host
  bytes *when it runs*, as a DMA does, so a slot rewritten before the copy ran
  shows up as wrong data; from pageable memory it copies at once, as CUDA stages
  pageable copies synchronously. A queued copy that finds its source no longer
  registered (or no longer mapped) is recorded in `violations` instead of reading;
* cudaHostRegister / cudaHostUnregister with injectable failures and a last-error
  state that only `clear_error()` resets, as cudaGetLastError;
* torch-created streams are listed by `streams(device)`; `external_stream()` ones
  are not (as torch.cuda.ExternalStream), unless current.

Every call is logged with the pid that made it (`calls`), so a test can prove
that forked children and finalisers make none.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time

import proc
import torch

ERROR_NAMES = {1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
               712: "cudaErrorHostMemoryAlreadyRegistered", 713: "cudaErrorHostMemoryNotRegistered"}


class SimStream:
    def __init__(self, sim, device: int, name: str, external: bool = False):
        self.sim = sim
        self.device = device
        self.name = name
        self.external = external
        self.ops: list = []  # ("work", label) | ("copy", fn) | ("wait", event)
        self.done = 0
        self.hung = False

    def __repr__(self):
        return f"<SimStream {self.name} dev{self.device} {self.done}/{len(self.ops)}>"


class SimEvent:
    def __init__(self, stream: SimStream):
        self.stream = stream
        self.position = len(stream.ops)

    @property
    def complete(self) -> bool:
        return self.stream.done >= self.position


def _index(device) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


def _mapped(start: int, end: int) -> bool:
    return any(lo <= start and end <= hi for lo, hi, _ in proc.maps())


class SimCuda:
    """poolloader.cuda.runtime.CudaRuntime on the CPU; see the module docstring."""

    def __init__(self, devices: int = 1, alarm_fd: int | None = None):
        self.num_devices = devices
        self.owner = os.getpid()
        self.alarm_fd = alarm_fd  # a pipe: any call from another process writes its pid there
        self.contexts: set[int] = set()
        self._streams: dict[int, list[SimStream]] = {d: [] for d in range(devices)}
        self._default: dict[int, SimStream] = {}
        self._local = threading.local()
        self.current_device = 0
        self.registered: dict[int, int] = {}  # address -> size
        self.last_error = 0
        self.fail_register: dict[int, int] = {}  # n-th register call (0-based) -> error code
        self.fail_unregister: dict[int, int] = {}
        self.register_calls = 0
        self.unregister_calls = 0
        self.calls: list[tuple[int, str]] = []
        self.events: list[SimEvent] = []  # every event recorded, in order
        self.pinned: list[torch.Tensor] = []  # pin_tensor's copies
        self.pinned_buffers: list[torch.Tensor] = []  # empty_pinned's buffers
        self.pin_devices: list = []
        self.violations: list[str] = []

    # -- test side -------------------------------------------------------------
    def _log(self, name: str) -> None:
        pid = os.getpid()
        self.calls.append((pid, name))
        if pid != self.owner and self.alarm_fd is not None:
            os.write(self.alarm_fd, f"{pid} {name}\n".encode())

    def _context(self, device: int) -> None:
        if device not in self.contexts:
            self.contexts.add(device)
            self._default[device] = SimStream(self, device, f"default{device}")
            self._streams[device].insert(0, self._default[device])

    def stream(self, device: int = 0, name: str = "side") -> SimStream:
        """A stream as torch.cuda.Stream() gives (listed by streams())."""
        self._context(device)
        s = SimStream(self, device, name)
        self._streams[device].append(s)
        return s

    def external_stream(self, device: int = 0) -> SimStream:
        """A stream torch did not create (ExternalStream): streams() does not list it."""
        self._context(device)
        return SimStream(self, device, "external", external=True)

    def _currents(self) -> dict:
        if not hasattr(self._local, "current"):
            self._local.current = {}
        return self._local.current

    @contextlib.contextmanager
    def use(self, stream: SimStream):
        """torch.cuda.stream(stream)."""
        currents = self._currents()
        before = currents.get(stream.device)
        currents[stream.device] = stream
        try:
            yield stream
        finally:
            if before is None:
                del currents[stream.device]
            else:
                currents[stream.device] = before

    def work(self, stream: SimStream, label: str = "kernel") -> None:
        """Queue a kernel (a training step, torch.cuda._sleep)."""
        stream.ops.append(("work", label))

    def copy(self, tensor: torch.Tensor, stream: SimStream | None = None) -> torch.Tensor:
        """`tensor.to("cuda", non_blocking=True)` on `stream` (default: current of device 0)."""
        if stream is None:
            stream = self.current_stream(0)
        if not tensor.is_contiguous():
            raise ValueError("the stand-in copies contiguous tensors only")
        out = torch.full_like(tensor, -1)
        src, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if not self._registered_range(src, nbytes):
            out.copy_(tensor)  # pageable: CUDA copies it before the call returns
            return out

        def run():  # holds the source's address only, as a DMA: not the tensor
            if not self._registered_range(src, nbytes) or not _mapped(src, src + nbytes):
                self.violations.append(f"a copy on {stream.name} read {nbytes} bytes at {src:#x} "
                                       "after they were unregistered")
                return
            ctypes.memmove(out.data_ptr(), src, nbytes)

        stream.ops.append(("copy", run))
        return out

    def _registered_range(self, start: int, nbytes: int) -> bool:
        return any(a <= start and start + nbytes <= a + n for a, n in self.registered.items())

    def run(self, stream: SimStream, upto: int | None = None) -> bool:
        """Run `stream` up to position `upto` (default: all); False if it cannot get there."""
        upto = len(stream.ops) if upto is None else upto
        while stream.done < upto:
            if stream.hung:
                return False
            kind, what = stream.ops[stream.done]
            if kind == "copy":
                what()
            elif kind == "wait" and not what.complete:
                if not self.run(what.stream, what.position):
                    return False
            stream.done += 1
        return True

    def run_all(self) -> None:
        for streams in self._streams.values():
            for s in streams:
                self.run(s)
        for s in self._currents().values():
            self.run(s)

    # -- CudaRuntime ------------------------------------------------------------------
    def devices_with_context(self):
        self._log("devices_with_context")
        return sorted(self.contexts)

    def streams(self, device):
        self._log("streams")
        listed = list(self._streams[device])
        current = self._currents().get(device)
        if current is not None and current not in listed:
            listed.append(current)
        return listed

    def current_stream(self, device):
        self._log("current_stream")
        device = _index(device)
        self._context(device)
        return self._currents().get(device, self._default[device])

    def new_stream(self, device):
        self._log("new_stream")
        return self.stream(_index(device), "stager")

    def stream_context(self, stream):
        self._log("stream_context")
        return self.use(stream)

    def stream_idle(self, stream):
        self._log("stream_idle")
        return stream.done == len(stream.ops)

    def stream_wait(self, stream, event):
        self._log("stream_wait")
        stream.ops.append(("wait", event))

    def record_event(self, stream):
        self._log("record_event")
        event = SimEvent(stream)
        self.events.append(event)
        return event

    def event_done(self, event):
        self._log("event_done")
        return event.complete

    def wait_events(self, events, timeout):
        self._log("wait_events")
        deadline = time.monotonic() + timeout
        for event in events:
            self.run(event.stream, event.position)
        if all(e.complete for e in events):
            return True
        time.sleep(max(0.0, deadline - time.monotonic()))  # a hung stream: the whole bound
        return all(e.complete for e in events)

    def copy_to(self, tensor, device):
        self._log("copy_to")
        return self.copy(tensor, self.current_stream(device))

    def record_stream(self, tensor, stream):
        self._log("record_stream")

    def pin_tensor(self, tensor, device):
        self._log("pin_tensor")
        out = tensor.clone()
        self.pinned.append(out)
        self.pin_devices.append(device)
        return out

    def is_pinned(self, tensor):
        self._log("is_pinned")
        address = tensor.untyped_storage().data_ptr()
        return any(t.layout == torch.strided and address == t.untyped_storage().data_ptr()
                   for t in self.pinned + self.pinned_buffers)

    def empty_pinned(self, nbytes):
        self._log("empty_pinned")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_buffers.append(buffer)
        return buffer

    def host_register(self, address, size):
        self._log("host_register")
        n, self.register_calls = self.register_calls, self.register_calls + 1
        self._context(self.current_device)
        code = self.fail_register.get(n, 0)
        if not code and any(a < address + size and address < a + s for a, s in self.registered.items()):
            code = 712
        if code:
            self.last_error = code
            return code
        self.registered[address] = size
        return 0

    def host_unregister(self, address):
        self._log("host_unregister")
        n, self.unregister_calls = self.unregister_calls, self.unregister_calls + 1
        code = self.fail_unregister.get(n, 0) or (0 if address in self.registered else 713)
        if code:
            self.last_error = code
            return code
        del self.registered[address]
        return 0

    def clear_error(self):
        self._log("clear_error")
        code, self.last_error = self.last_error, 0
        return code

    def error_name(self, code):
        return ERROR_NAMES.get(code, f"cudaError {code}")
