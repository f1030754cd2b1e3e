"""CUDA: register slots as page-locked once, and gate slot reuse behind events.

PyTorch does not track copies out of memory it did not allocate, so when the
last view of a batch dies the slot may still be the source of an async
host-to-device copy. The iterator (never a finaliser) calls `cool(slot)`,
which records an event on the current stream; the slot becomes FREE only when
that event has completed (`ready()`).
"""
from __future__ import annotations

import collections

import torch


# cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinning.
_HOST_REGISTER_PORTABLE = 1


def _check(rc, what: str) -> None:
    code = int(rc)
    if code != 0:
        raise RuntimeError(f"{what} failed with cudaError {code}")


class SlotGate:
    """`device`: where the batches' copies run (None: the current device); events
    are recorded on that device's current stream."""

    def __init__(self, device=None) -> None:
        if device is not None and torch.device(device).type != "cuda":
            device = None
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        self._cudart = torch.cuda.cudart()
        self._cooling: collections.deque = collections.deque()  # (slot, event)
        self._registered: dict[int, int] = {}  # mapping address -> size

    def register(self, mapping) -> None:
        """cudaHostRegister the whole mapping once, at creation (not per batch)."""
        _check(self._cudart.cudaHostRegister(mapping.address, mapping.size, _HOST_REGISTER_PORTABLE),
               f"cudaHostRegister of {mapping.size} bytes")
        self._registered[mapping.address] = mapping.size

    def unregister(self, mapping) -> None:
        """Before a mapping is replaced or dropped; views still alive become pageable."""
        if self._registered.pop(mapping.address, None) is not None:
            _check(self._cudart.cudaHostUnregister(mapping.address), "cudaHostUnregister")

    def cool(self, key) -> None:
        """`key` (a slot, or a mapping detached from the pool) is free once the
        event recorded now has completed."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._cooling.append((key, event))

    @property
    def pending(self) -> int:
        return len(self._cooling)

    def keys(self) -> list:
        return [key for key, _event in self._cooling]

    def ready(self, wait: bool) -> list:
        """Slots whose event completed, oldest first; with `wait`, block on the
        oldest if none has."""
        out = []
        while self._cooling and self._cooling[0][1].query():
            out.append(self._cooling.popleft()[0])
        if not out and wait and self._cooling:
            slot, event = self._cooling.popleft()
            event.synchronize()
            out.append(slot)
        return out

    def close(self) -> None:
        """Before the pool unregisters and unmaps: wait for every copy that may
        still read a slot (cooling ones, and the consumer's copies of leased ones)."""
        for slot, event in self._cooling:
            event.synchronize()
        self._cooling.clear()
        torch.cuda.current_stream(self.device).synchronize()


def to_device(obj, device, non_blocking: bool = True):
    """Move every tensor of a batch to `device`, keeping its structure.

    Tensors move one by one; objects with a `.to(device, non_blocking=...)`
    method of their own (PackedTargets) move as a whole, one tensor per field.
    Mappings, namedtuples, lists and tuples are rebuilt; everything else is
    returned as is.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device, non_blocking)) for k, v in obj.items()) \
            if type(obj) is not dict else {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    move = getattr(obj, "to", None)
    if callable(move) and hasattr(obj, "pin_memory"):
        return move(device, non_blocking=non_blocking)
    return obj


def record_on(obj, stream) -> None:
    """record_stream every device tensor of a batch on `stream`, so the caching
    allocator does not hand their memory out while `stream` may still use it."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            obj.record_stream(stream)
    elif isinstance(obj, dict):
        for v in obj.values():
            record_on(v, stream)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            record_on(v, stream)
    elif hasattr(obj, "fields") and isinstance(getattr(obj, "fields"), dict):
        record_on(obj.fields, stream)
        counts = getattr(obj, "counts", None)
        if isinstance(counts, torch.Tensor):
            record_on(counts, stream)


class DeviceStager:
    """Copies each batch to the device on a side stream, one batch ahead.

    `stage(host_batch)` enqueues the copies and returns a ticket; `deliver(ticket)`
    makes the consumer's current stream wait for the copy, marks the device
    tensors as used by that stream, and returns the device batch. The ticket keeps
    the host batch (its slot lease) alive until then, and the slot's later reuse
    is gated by an event on the current stream, which now follows the copy.
    """

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def stage(self, host_batch):
        if self.stream is None:
            return (to_device(host_batch, self.device, non_blocking=False), None, None)
        with torch.cuda.stream(self.stream):
            dev = to_device(host_batch, self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return (dev, event, host_batch)

    def wait(self, ticket) -> None:
        """Block until a staged ticket's copy is done (before its slot may be reused)."""
        if ticket[1] is not None:
            ticket[1].synchronize()

    def deliver(self, ticket):
        dev, event, _host = ticket
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            record_on(dev, current)
        return dev
