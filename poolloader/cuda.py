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


def _check(rc, what: str) -> None:
    code = rc if isinstance(rc, int) else getattr(rc, "value", 0)
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


class SlotGate:
    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()
        self._cooling: collections.deque = collections.deque()  # (slot, event)
        self._registered: dict[int, int] = {}  # mapping address -> size

    def register(self, mapping) -> None:
        """cudaHostRegister the whole mapping once, at creation (not per batch)."""
        _check(self._cudart.cudaHostRegister(mapping.address, mapping.size, 0),
               f"cudaHostRegister of {mapping.size} bytes")
        self._registered[mapping.address] = mapping.size

    def unregister(self, mapping) -> None:
        """Before a mapping is replaced or dropped; views still alive become pageable."""
        if self._registered.pop(mapping.address, None) is not None:
            _check(self._cudart.cudaHostUnregister(mapping.address), "cudaHostUnregister")

    def cool(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self._cooling.append((slot, event))

    def ready(self, wait: bool) -> list[int]:
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
        for slot, event in self._cooling:
            event.synchronize()
        self._cooling.clear()
