"""CUDA: slots registered page-locked once, and a gate that reuses a slot only after
every copy that may read it has finished, on any stream or device.

Why a gate. torch tracks the copies out of memory its own host allocator made
(`pin_memory()`: an event per copy, on the copy's stream), never out of memory it did
not allocate. A slot registered with cudaHostRegister is such memory: after
`batch.to("cuda", non_blocking=True)` the copy is only queued, on whatever stream was
current (a prefetcher's side stream, DataParallel's per-device copy streams, another
thread's stream), and the batch may die long before the copy runs.

What the gate waits for. When a batch's last view dies its lease queues the slot (a
deque append: no lock, no CUDA call). The iterator finds it on its next call and calls
`release(key)`, which takes a *marker*: on every device that has a CUDA context, an
event on every stream that may have work queued and still has (the default stream,
every stream torch's pool has handed out so far — what `torch.cuda.Stream()` gives,
to anyone, before or after the loader started —, the calling thread's current stream,
and streams given to `poolloader.watch_stream`). Every copy of the batch was queued
before the batch died, so before the marker on its stream, or it has already run: the
key is ready when all the marker's events have completed. A pool stream nobody took
has nothing queued, so the marker costs O(streams the program took), not O(torch's
pool) (runtime._PoolWatch says how they are found, and when it must assume all).
With `device=` the only reader is the stager's copy stream, so the marker is the
stager's own copy event. Streams torch did not hand out (`torch.cuda.ExternalStream`,
another library's) cannot be seen unless current at the release: register one that
copies batches with `poolloader.watch_stream(stream)`, or order it before the current
stream (`current_stream().wait_stream(s)`) before the next `next()`. torch's default
stream and pool streams are non-blocking, so an event on the current stream alone
would not cover a side stream's copy.

Per batch the gate makes a constant number of CUDA calls: the marker above, a poll of
the oldest cooling key only (`ready()`), and one page-lock check per storage in `pin()`
(a batch's small tensors share one buffer, allocated page-locked).

The CUDA surface all this uses is `CudaRuntime` below: `TorchCuda` implements it over
torch.cuda and torch.cuda.cudart(); the tests drive the same gate with a deterministic
CPU stand-in (tests/cuda_standin.py) passed as `loader._cuda_runtime`.

Contract of SlotGate (main process, one thread: the one that iterates):
  keys                        opaque hashables: a slot index, or a retired Mapping
                              (a detached slot's old segment, which lives with the
                              user's batch until its last view dies).
  register(mapping, slot)     SlotPool's on_map: cudaHostRegister once per mapping
                              (never per batch or epoch). Raises CudaRegistrationError
                              naming the slot, size and CUDA error; the error is cleared.
  unregister(mapping, slot)   SlotPool's on_unmap, before a mapping is unmapped; also
                              main, for a retired mapping once ready() returned it.
                              Never raises: a failure is cleared, warned (slot, size,
                              error name) and kept in `errors`, and the caller goes on.
                              Do NOT call it when a leased slot is detached: the old
                              mapping stays registered until its release has cooled.
                              At teardown (the pool's close), a mapping a batch the
                              user holds still views (a lease) stays registered and
                              mapped: it is unregistered once its last view died and
                              a marker taken after that completed (finish_deferred,
                              at this process's next gate release or iter()).
  release(key)                the batch in `key` was released (iterator, on its next
                              call; never from a weakref callback or finaliser).
  ready() -> [keys]           non-blocking: keys whose marker completed, in release
                              order. A slot key is FREE again; a mapping key is to be
                              unregister()ed and dropped.
  pending                     keys still cooling: count them as in flight (grow the
                              pool rather than wait while it may grow).
  wait_any(timeout) -> [keys] bounded wait for the oldest cooling key; counted in
                              stats.cooling_waits / cooling_wait_s. [] on timeout.
  close(timeout) -> [keys]    teardown, after the workers stopped and before the pool
                              unmaps: waits (bounded) for every cooling key and for a
                              fresh marker that covers copies of leased and staged
                              batches; returns the keys that were cooling (unregister
                              the mapping keys among them). If the wait times out, the
                              mappings stay registered and mapped (warning) and are
                              finished by the next gate of this process.
  defer()                     before teardown from a finaliser (`__del__`) or atexit:
                              close() and unregister() then make no CUDA call; the next
                              gate created in this process finishes the job.
  pin(batch)                  DataLoader's pin_memory for everything that is not a view
                              of a registered mapping.
A gate does nothing in a process other than the one that made it (forked children
inherit the object, never use it).
"""
from __future__ import annotations

import bisect
import os
import time
from typing import Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _torch_pin_memory

from poolloader.cuda.runtime import CudaRuntime, torch_runtime
from poolloader.cuda.staging import DESCEND, DeviceStager, HostStager, map_batch
from poolloader.errors import CudaRegistrationError, warn

# How long the iterator waits for a cooling slot when the pool may not grow (seconds).
COOL_TIMEOUT_S = 300.0
# How long teardown waits for copies that may still read a slot (seconds).
CLOSE_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------
# the gate

_deferred: list[SlotGate] = []  # gates whose teardown waits for a safe point


def finish_deferred(block: bool = True) -> None:
    """Finish the teardowns that finalisers, atexit or a timed-out close left.

    With `block` (when a gate is made, i.e. from `iter(loader)`) it waits, bounded, for
    a fresh marker and unregisters, except the mappings a batch the user holds still
    views (those wait for the look below, once their last view died). Without (any
    live gate's release(), so an abandoned pool does not hold its memory until the
    next `iter()`) it only looks: a pool whose batches the user no longer holds is
    finished once a marker taken after its last view died has completed."""
    for gate in list(_deferred):
        if gate._owner_pid == os.getpid() and gate._finish(block):
            _deferred.remove(gate)


class SlotGate:
    """See the module docstring for the contract. `stats`: a LoaderStats (cooling counters)."""

    def __init__(self, runtime: CudaRuntime, stats=None) -> None:
        self._rt = runtime
        self._stats = stats
        self._owner_pid = os.getpid()
        self._cooling: dict[Any, list] = {}  # key -> events not yet seen complete; release order
        self._registered: dict[int, tuple[Any, Any]] = {}  # address -> (mapping, slot)
        self._starts: list[int] = []  # registered ranges, sorted, for is_slot_view
        self._ends: list[int] = []
        self._copy_event = None  # device=: the stager's latest copy event, called
        self._small_span = (0, 0)  # [start, end) of the small buffer made last (small_buffer)
        self._small: torch.Tensor | None = None
        self._host_views = False  # device=: a delivered batch kept host views of a slot
        self._deferring = False
        self._closed = False
        self._parked: list = []  # events a deferred teardown still waits for
        self._final: list | None = None  # finish_deferred(block=False): its marker
        self._quarantine: list[tuple[Any, Any, memoryview]] = []  # (mapping, slot, view)
        self.errors: list[str] = []
        finish_deferred()

    def _mine(self) -> bool:
        return os.getpid() == self._owner_pid

    # -- registration ---------------------------------------------------------
    def register(self, mapping, slot=None) -> None:
        if not self._mine():
            raise RuntimeError("internal error: a slot was registered in a forked child")
        code = self._rt.host_register(mapping.address, mapping.size)
        if code:
            self._rt.clear_error()
            raise CudaRegistrationError(
                f"cudaHostRegister of slot {slot} ({mapping.size} bytes at {mapping.address:#x}) "
                f"failed with {self._rt.error_name(code)} ({code}). Lower slot_bytes, "
                "num_workers or prefetch_factor, or pass pin_memory=False (copies are then "
                "synchronous, as from any pageable tensor).")
        self._registered[mapping.address] = (mapping, slot)
        self._index()

    def unregister(self, mapping, slot=None) -> bool:
        """True if it was registered and cudaHostUnregister succeeded."""
        entry = self._registered.get(mapping.address)
        if entry is None or entry[0] is not mapping or not self._mine():
            return False
        if slot is None:
            slot = entry[1]
        if self._deferring or self._closed and self._parked or mapping.leases:
            # copies may still read it, or a batch the user holds views it (teardown of
            # a pool whose batch outlives it): keep it registered and mapped (an export
            # makes the pool's retire() leave it mapped) until the teardown can finish,
            # for a held batch once its last view died (_finish)
            self._quarantine.append((mapping, slot, memoryview(mapping)))
            if not self._deferring and self not in _deferred:
                _deferred.append(self)  # finished by this process's next gate activity
            return False
        del self._registered[mapping.address]
        self._index()
        return self._unregister_now(mapping, slot)

    def _unregister_now(self, mapping, slot) -> bool:
        code = self._rt.host_unregister(mapping.address)
        if not code:
            return True
        self._rt.clear_error()
        message = (f"PoolLoader: cudaHostUnregister of slot {slot} ({mapping.size} bytes at "
                   f"{mapping.address:#x}) failed with {self._rt.error_name(code)} ({code}); "
                   "the error was cleared and teardown went on")
        self.errors.append(message)
        warn(message, RuntimeWarning)
        return False

    def _index(self) -> None:
        spans = sorted((a, a + m.size) for a, (m, _slot) in self._registered.items())
        self._starts = [a for a, _ in spans]
        self._ends = [b for _, b in spans]

    def is_slot_view(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s whole storage lies in a registered mapping (then it is
        page-locked already: `is_pinned()` and async copies, nothing to pin)."""
        if tensor.layout != torch.strided or tensor.device.type != "cpu" or not self._starts:
            return False
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + storage.nbytes() <= self._ends[i]

    # -- pinning ----------------------------------------------------------------
    def pin(self, batch, device=None):
        """DataLoader's pin_memory for a host batch: views of registered slots stay as
        they are; other tensors (pickled fallbacks: sparse, subclasses, requires_grad)
        are pinned by torch, and a custom type's pin_memory() is called, as
        DataLoader's pin-memory thread does (a type with `map_tensors`, PackedTargets,
        has its tensors treated as the batch's). Looks once per storage: the batch's
        small tensors share one buffer, allocated page-locked (`small_buffer`)."""
        rt = self._rt
        seen = {}  # storage address -> page-locked already (untyped def: no annotation)
        small_start, small_end = self._small_span
        self._small_span, self._small = (0, 0), None

        def pin_tensor(x):
            try:
                address = x.data_ptr()
            except RuntimeError:  # no storage: sparse, nested
                address = -1
            if small_start <= address < small_end:
                return x  # a view of the batch's small buffer (page-locked): no storage lookup
            if x.device.type == "cpu" and x.layout == torch.strided:
                address = x.untyped_storage().data_ptr()
                locked = seen.get(address)
                if locked is None:
                    locked = seen[address] = self.is_slot_view(x) or rt.is_pinned(x)
                if locked:
                    return x  # a slot view, or in the batch's pinned small buffer
            return rt.pin_tensor(x, device)

        def leaf(x):
            if isinstance(x, torch.Tensor):
                return pin_tensor(x)
            if callable(getattr(x, "map_tensors", None)):  # PackedTargets: its tensors alike
                return x.map_tensors(pin_tensor)
            if hasattr(x, "pin_memory"):
                return x.pin_memory()
            return DESCEND

        return map_batch(batch, leaf)

    def small_buffer(self, nbytes: int) -> torch.Tensor:
        """A batch's private buffer for its small tensors, page-locked (codec.decode).
        pin() of the batch decoded last knows its tensors there by address alone."""
        buffer = self._rt.empty_pinned(nbytes)
        start = buffer.data_ptr()
        # held until that pin(): its memory cannot be handed to another tensor meanwhile
        self._small, self._small_span = buffer, (start, start + nbytes)
        return buffer

    # -- cooling -------------------------------------------------------------------
    def use_copy_events(self, latest) -> None:
        """device=: the stager's copies are the only readers; `latest()` is its last copy event."""
        self._copy_event = latest

    def note_host_views(self) -> None:
        """device=: a delivered batch kept something that may view a slot (an array, an
        unknown object): from now on releases take the full marker too."""
        self._host_views = True

    def _marker(self) -> list:
        """Events that complete only after every copy queued so far that may read a
        released batch (see the module docstring)."""
        if self._copy_event is not None:
            event = self._copy_event()
            events = [] if event is None else [event]
            if not self._host_views:
                return events
        else:
            events = []
        rt = self._rt
        for device in rt.devices_with_context():
            for stream in rt.streams(device):
                if not rt.stream_idle(stream):
                    events.append(rt.record_event(stream))
        return events

    def release(self, key) -> None:
        if not self._mine() or self._closed:
            return
        if _deferred:
            finish_deferred(block=False)
        if key in self._cooling:
            raise RuntimeError(f"internal error: {key!r} released twice")
        self._cooling[key] = self._marker()

    @property
    def pending(self) -> int:
        return len(self._cooling)

    def cooling_keys(self) -> list:
        return list(self._cooling)

    def ready(self) -> list:
        # Only the oldest cooling key is polled, and only until one of its events is
        # not done: O(1) per call, however many keys cool. Keys are returned in
        # release order, each only once its own events completed. A later key is
        # usually done no earlier than an older one (a stream runs its work in order,
        # and a later marker has an event on every stream still busy from an earlier
        # one). Where a later key completes first (the older one's event is on a
        # stream that was current then and is not listed now, e.g. an ExternalStream),
        # it waits behind the older key: released later than it could be, never early.
        cooling = self._cooling
        if not cooling or not self._mine():
            return []
        done = self._rt.event_done
        out = []
        for key, events in cooling.items():
            while events and done(events[-1]):
                events.pop()
            if events:
                break
            out.append(key)
        for key in out:
            del cooling[key]
        return out

    def wait_any(self, timeout: float) -> list:
        got = self.ready()
        if got or not self._cooling:
            return got
        t0 = time.perf_counter()
        oldest = next(iter(self._cooling.values()))
        self._rt.wait_events(list(oldest), timeout)
        got = self.ready()
        if self._stats is not None:
            self._stats.cooling_waits += 1
            self._stats.cooling_wait_s += time.perf_counter() - t0
        return got

    # -- teardown ---------------------------------------------------------------------
    def defer(self) -> None:
        self._deferring = True

    def close(self, timeout: float | None = None) -> list:
        if not self._mine() or self._closed:
            return []
        self._closed = True
        keys = list(self._cooling)
        self._parked += [e for events in self._cooling.values() for e in events]
        self._cooling.clear()
        self._copy_event = None
        if self._deferring:
            _deferred.append(self)
            return keys
        self._parked += self._marker()
        timeout = CLOSE_TIMEOUT_S if timeout is None else timeout
        if self._rt.wait_events(self._parked, timeout):
            self._parked = []
        else:
            warn(
                f"PoolLoader: CUDA copies from the pool did not finish within {timeout:.0f} s "
                "of teardown; its slots stay registered and mapped until a later loader "
                "starts (or the process exits).", RuntimeWarning)
            _deferred.append(self)
        return keys

    def keep(self, events) -> None:
        """Events a stager still holds at teardown: kept until teardown finishes, so
        that none is destroyed by a finaliser."""
        self._parked.extend(e for e in events if e is not None)

    def _finish(self, block: bool = True) -> bool:
        """A deferred teardown: wait for what was parked plus a marker, then unregister
        the quarantined mappings no held batch views. True when done (none is left).

        The marker must follow every copy the user may issue from these mappings: with
        `block` it is taken now and waited for (bounded) with no user code in between;
        without, only once no view but ours is left (nobody can issue a copy any more),
        and it is polled, never waited for."""
        self._deferring = False
        held = [entry for entry in self._quarantine if _held(entry)]
        if block:
            if not self._rt.wait_events(self._parked + self._marker(), CLOSE_TIMEOUT_S):
                return False
            self._parked = []  # waited for: the held mappings need a marker of their own
        else:
            if held:
                return False  # the user still holds batches of this pool
            if self._final is None:
                self._final = self._parked + self._marker()
            done = self._rt.event_done
            self._final = [e for e in self._final if not done(e)]
            if self._final:
                return False
        self._parked = []
        self._final = None
        quarantine, self._quarantine = self._quarantine, held
        for entry in quarantine:
            if any(entry is h for h in held):
                continue  # a batch the user holds views it: stays page-locked and mapped
            mapping, slot, view = entry
            view.release()
            self._registered.pop(mapping.address, None)
            self._unregister_now(mapping, slot)
        self._index()
        return not held


def _held(entry) -> bool:
    """Whether a quarantined (mapping, slot, view) is still viewed by a batch the user
    holds (a lease, or an export besides the quarantine's own view)."""
    mapping = entry[0]
    return bool(mapping.exports > 1 or mapping.leases)


def setup(loader, pin_memory: bool, pin_memory_device=None):
    """(gate, stager) for one iterator of `loader`, either may be None.

    `pin_memory` and `pin_memory_device` are what DataLoader's base iterator decided
    (pin_memory is off where there is no accelerator). `loader._cuda_runtime`, when
    set, replaces torch.cuda (the tests' CPU stand-in); pin_memory is then the loader's.
    """
    runtime = getattr(loader, "_cuda_runtime", None)
    if runtime is not None:  # DataLoader saw no accelerator: decide as it would with one
        pin_memory = loader.pin_memory
        pin_memory_device = loader.pin_memory_device or None
    device = getattr(loader, "device", None)
    device = torch.device(device) if device is not None else None
    wants_cuda = (device.type == "cuda") if device is not None else pin_memory
    if runtime is None and wants_cuda and torch.cuda.is_available():
        runtime = torch_runtime()  # initialises CUDA: only for loaders that use it
    if device is not None:
        if device.type == "cuda" and runtime is None:
            raise ValueError(f"device={str(device)!r} needs CUDA, which this machine does not "
                             "have; pass device=None (or 'cpu')")
        if runtime is None or device.type != "cuda":
            return None, DeviceStager(None, device, None)
        gate = SlotGate(runtime, loader.stats)
        return gate, DeviceStager(runtime, device, gate)
    if not pin_memory:
        return None, None
    pin_type = torch.device(pin_memory_device).type if pin_memory_device else "cuda"
    if runtime is None or pin_type != "cuda":
        # another accelerator: slots cannot be registered; pin as DataLoader does (a copy)
        return None, HostStager(lambda batch: _torch_pin_memory(batch, pin_memory_device))
    gate = SlotGate(runtime, loader.stats)
    return gate, HostStager(lambda batch: gate.pin(batch, pin_memory_device))
