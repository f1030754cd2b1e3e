"""The control block: one small shared segment per pool that every process maps.

It holds what main and the workers must agree on besides the slots themselves:
which generation of each slot's segment is current, which generation each
worker has mapped (so main knows when a name may be unlinked), one request ring
and one done ring per worker, and the doorbell workers ring after each push.

Layout (byte offsets; every block starts on a 64-byte line). Keep in sync with
the readers below; both sides use these functions only:

    0    header, 8 u64 fields:
           [0] MAGIC            CONTROL_MAGIC once initialised
           [1] num_workers
           [2] max_slots        capacity of every table and ring
           [3] num_slots        slots currently in the pool (main grows it)
           [4] growth_counter   bumped by main after any slot table change
           [5] main_pid         the process that owns every name
           [6] reserved
           [7] reserved
    64   doorbell             DOORBELL_BYTES
    A    slot table           max_slots × (generation u64, size u64)
    B    ack table            num_workers × max_slots u64: generation mapped by each worker
    S    worker stats         num_workers × 4 u64, written by each worker for itself:
           [0] batches produced  [1] ns producing (fetch + collate + encode)
           [2] ns waiting for a request (idle: no free slot / consumer slow)
           [3] reserved
    C    rings                per worker: request ring, done ring (capacity max_slots each)
"""
from __future__ import annotations

import numpy as np

from poolloader._ring import DOORBELL_BYTES, Doorbell, Ring

CONTROL_MAGIC = 0x6C6F72746E6F434C  # "LControl"
_HEADER_FIELDS = 8
H_MAGIC, H_WORKERS, H_MAX_SLOTS, H_NUM_SLOTS, H_GROWTH, H_MAIN_PID = range(6)


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


class ControlLayout:
    """Offsets of each block for a given worker count and slot bound."""

    def __init__(self, num_workers: int, max_slots: int):
        self.num_workers = num_workers
        self.max_slots = max_slots
        self.doorbell = 64
        self.slot_table = _align(self.doorbell + DOORBELL_BYTES)
        self.ack_table = _align(self.slot_table + 16 * max_slots)
        self.worker_stats = _align(self.ack_table + 8 * num_workers * max_slots)
        self.rings = _align(self.worker_stats + 32 * num_workers)
        self.ring_bytes = _align(Ring.nbytes(max_slots))
        self.nbytes = _align(self.rings + 2 * num_workers * self.ring_bytes, 4096)

    def request_ring_offset(self, worker: int) -> int:
        return self.rings + 2 * worker * self.ring_bytes

    def done_ring_offset(self, worker: int) -> int:
        return self.rings + (2 * worker + 1) * self.ring_bytes


class Control:
    """Typed views over a mapped control segment.

    `create=True` (main, once) initialises the header, doorbell and rings;
    workers attach with `create=False` after reading num_workers/max_slots.
    """

    def __init__(self, mapping, num_workers: int, max_slots: int, create: bool):
        self.layout = lay = ControlLayout(num_workers, max_slots)
        self.mapping = mapping
        self.header = np.ndarray((_HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0)
        # slot_table[s] = (generation, size in bytes) of slot s's current segment
        self.slot_table = np.ndarray((max_slots, 2), np.uint64, buffer=mapping, offset=lay.slot_table)
        # acks[w, s] = generation of slot s that worker w has mapped (0: none)
        self.acks = np.ndarray((num_workers, max_slots), np.uint64, buffer=mapping, offset=lay.ack_table)
        # worker_stats[w] = (batches, producing ns, waiting ns, reserved)
        self.worker_stats = np.ndarray((num_workers, 4), np.uint64, buffer=mapping,
                                       offset=lay.worker_stats)
        if create:
            self.header[:] = 0
            self.slot_table[:] = 0
            self.acks[:] = 0
            self.worker_stats[:] = 0
            self.header[H_WORKERS] = num_workers
            self.header[H_MAX_SLOTS] = max_slots
        self.doorbell = Doorbell(mapping, lay.doorbell, create=create)
        cap = max_slots if create else None
        self.request_rings = [Ring(mapping, lay.request_ring_offset(w), capacity=cap) for w in range(num_workers)]
        self.done_rings = [Ring(mapping, lay.done_ring_offset(w), capacity=cap) for w in range(num_workers)]
        if create:
            self.header[H_MAGIC] = CONTROL_MAGIC

    @staticmethod
    def read_shape(mapping) -> tuple[int, int]:
        """(num_workers, max_slots) of an initialised control segment."""
        header = np.ndarray((_HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0)
        if int(header[H_MAGIC]) != CONTROL_MAGIC:
            raise ValueError("internal error: control segment is not initialised")
        return int(header[H_WORKERS]), int(header[H_MAX_SLOTS])

    def close_views(self) -> None:
        """Drop every view so the mapping can be unmapped."""
        self.header = self.slot_table = self.acks = self.worker_stats = None
        self.doorbell = None
        self.request_rings = self.done_rings = []
