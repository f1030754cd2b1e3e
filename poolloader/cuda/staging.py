"""Delivery of a host batch: DataLoader's pinning rules, and `device=` copies one ahead.

`map_batch` walks a batch with torch's pin_memory container rules (defaultdict,
namedtuples, custom mappings keep their types); `HostStager` pins each batch as
DataLoader's pin-memory thread would; `DeviceStager` copies each batch to the device
on a side stream, one batch ahead, and hands the reuse gate its copy events.
"""
from __future__ import annotations

import collections
import copy
from typing import Callable, Protocol

import torch

from poolloader.cuda.runtime import CudaRuntime


class CopyGate(Protocol):
    """What a DeviceStager tells the reuse gate (poolloader.cuda.gate.SlotGate)."""

    def use_copy_events(self, latest: Callable[[], object]) -> None: ...
    def note_host_views(self) -> None: ...
    def keep(self, events: list) -> None: ...

# ---------------------------------------------------------------------------
# walking a batch: torch's pin_memory container rules

DESCEND = object()


def map_batch(data, leaf, other=None):
    """Rebuild `data` as torch's DataLoader pin_memory does
    (torch/utils/data/_utils/pin_memory.py), with `leaf(obj)` deciding first.

    `leaf` returns the replacement of `obj`, or DESCEND to let containers be rebuilt
    (mutable mappings and sequences are shallow-copied and updated, so a defaultdict
    keeps its default_factory); anything else is returned as is, after `other(obj)`.
    """
    got = leaf(data)
    if got is not DESCEND:
        return got
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        try:
            if isinstance(data, collections.abc.MutableMapping):
                clone = copy.copy(data)
                clone.update({k: map_batch(v, leaf, other) for k, v in data.items()})
                return clone
            return type(data)({k: map_batch(v, leaf, other) for k, v in data.items()})
        except TypeError:
            return {k: map_batch(v, leaf, other) for k, v in data.items()}
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(map_batch(v, leaf, other) for v in data))
        return type(data)(map_batch(v, leaf, other) for v in data)
    if isinstance(data, collections.abc.Sequence):
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone = copy.copy(data)
                for i, item in enumerate(data):
                    clone[i] = map_batch(item, leaf, other)
                return clone
            return type(data)([map_batch(v, leaf, other) for v in data])
        except TypeError:
            return [map_batch(v, leaf, other) for v in data]
    if other is not None:
        other(data)
    return data


def _movable(obj) -> bool:
    """A batch type that moves itself (PackedTargets): `.to(device, non_blocking=)` and `pin_memory()`."""
    return callable(getattr(obj, "to", None)) and hasattr(obj, "pin_memory")


def to_device(obj, device, non_blocking: bool = True, copy_to=None):
    """Move every tensor of a batch to `device`, keeping its structure (torch's
    pin_memory container rules: defaultdict, namedtuple, custom mappings).

    Objects with `.to(device, non_blocking=...)` and `pin_memory()` of their own
    (PackedTargets) move as a whole; everything else is returned as is.
    """
    if copy_to is None:
        def copy_to(t, dev):
            return t.to(dev, non_blocking=non_blocking)

    def leaf(x):
        if isinstance(x, torch.Tensor):
            return copy_to(x, device)
        if _movable(x):
            return x.to(device, non_blocking=non_blocking)
        return DESCEND

    return map_batch(obj, leaf)


def record_on(obj, stream, record) -> None:
    """`record(tensor, stream)` for every tensor of a device batch (PackedTargets'
    fields and counts included), so the caching allocator does not hand their memory
    out while `stream` may still use it."""
    if isinstance(obj, torch.Tensor):
        record(obj, stream)
    elif isinstance(obj, collections.abc.Mapping):
        for v in obj.values():
            record_on(v, stream, record)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            record_on(v, stream, record)
    elif isinstance(getattr(obj, "fields", None), dict):
        record_on(obj.fields, stream, record)
        counts = getattr(obj, "counts", None)
        if isinstance(counts, torch.Tensor):
            record(counts, stream)


_PLAIN = (int, float, complex, bool, str, bytes, type(None))


# ---------------------------------------------------------------------------
# delivery: what the iterator's _next_data calls

class HostStager:
    """`pin_memory=True` without `device=`: DataLoader's pinning, applied to each batch."""

    def __init__(self, pin) -> None:
        self._pin = pin

    def next(self, get_host_batch):
        return self._pin(get_host_batch())

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class DeviceStager:
    """`device=`: copies each batch to the device on a side stream, one batch ahead.

    `next(get_host_batch)` returns the batch staged at the previous call (after making
    the consumer's current stream wait for its copy and marking its tensors as used
    by that stream) and stages the following one, so its copy overlaps the
    consumer's work. An error met while staging the following batch is raised at the
    call after, once the batch before it was delivered. The gate gates a slot's reuse
    on the latest copy event (copies run in order on the one side stream).

    Without CUDA (e.g. device="cpu") the copies are synchronous and nothing is gated.
    """

    def __init__(self, runtime: CudaRuntime | None, device, gate: CopyGate | None) -> None:
        self.device = torch.device(device)
        self._rt = runtime if self.device.type == "cuda" else None
        self._gate = gate
        self.stream = self._rt.new_stream(self.device) if self._rt is not None else None
        self._last_copy = None
        if gate is not None and self._rt is not None:
            gate.use_copy_events(lambda: self._last_copy)
        self._staged = None  # (device batch, copy event, host batch)
        self._host_done = False
        self._deferred_error: BaseException | None = None

    def next(self, get_host_batch):
        if self._staged is None:
            if self._deferred_error is not None:
                error, self._deferred_error = self._deferred_error, None
                raise error
            if self._host_done:
                raise StopIteration
            self._staged = self._stage(get_host_batch())
        # stays staged until delivered: a teardown meanwhile covers its copy. Not its host
        # batch: a teardown while the next one is fetched (the epoch's end) drops that
        # (close()), so the pool unregisters the slot then, as no user view holds it
        ticket = self._staged[:2]
        following = None
        try:
            following = self._stage(get_host_batch())
        except StopIteration:
            self._host_done = True
        except Exception as error:  # delivered after the batch already copied
            self._deferred_error = error
        self._staged = following
        return self._deliver(ticket)

    def _stage(self, host_batch):
        rt = self._rt
        if rt is None:
            return (to_device(host_batch, self.device, non_blocking=False), None, None)
        escaped = False

        def other(x):
            nonlocal escaped
            if not isinstance(x, _PLAIN):
                escaped = True  # e.g. a numpy view of the slot, which the user may copy too

        def leaf(x):
            if isinstance(x, torch.Tensor):
                return rt.copy_to(x, self.device)
            if _movable(x):
                return x.to(self.device, non_blocking=True)
            return DESCEND

        with rt.stream_context(self.stream):
            try:
                dev = map_batch(host_batch, leaf, other)
            finally:  # copies issued before an error are covered too
                self._last_copy = rt.record_event(self.stream)
        if escaped and self._gate is not None:
            self._gate.note_host_views()
        return (dev, self._last_copy, host_batch)

    def _deliver(self, ticket):
        dev, event = ticket
        if event is not None:
            current = self._rt.current_stream(self.device)
            self._rt.stream_wait(current, event)
            record_on(dev, current, self._rt.record_stream)
        return dev

    def reset(self) -> None:
        """A new epoch: drop what was staged (its slot's reuse waits for its copy event)."""
        self._staged = None
        self._host_done = False
        self._deferred_error = None

    def close(self) -> None:
        """Teardown: the gate's close() covers the staged copy; hand it our events so
        none dies in a finaliser."""
        if self._gate is not None:
            self._gate.keep([self._last_copy, self._staged[1] if self._staged else None])
        self._staged = None
        self._last_copy = None
