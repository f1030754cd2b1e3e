"""The control block: one small shared segment per pool that every process maps.

It holds what main and the workers must agree on besides the slots themselves:
which generation of each slot's segment is current, which generation each
worker has mapped (so main knows when a name may be unlinked), one request ring
and one done ring per worker, the doorbell workers ring after each push, and, where
fewer processes host the workers (PoolLoader(node_workers=P)), one request doorbell
per hosting process, which main rings after each push to a request ring it serves.

Layout (byte offsets; every block starts on a 64-byte line). Keep in sync with
the readers below; both sides use these functions only:

    0    header, 8 u64 fields:
           [0] MAGIC            CONTROL_MAGIC once initialised
           [1] num_workers
           [2] max_slots        capacity of every table and ring
           [3] num_slots        slots currently in the pool (main grows it)
           [4] growth_counter   bumped by main after any slot table change
           [5] main_pid         pid of the owner, for people debugging only: liveness is
                                the owner lock on this segment (pool.py)
           [6] hosts            physical processes hosting the (logical) workers, each
                                waiting on its request doorbell; 0: every worker is its
                                own process and waits on its request ring
           [7] reserved
    64   doorbell             DOORBELL_BYTES
    A    slot table           max_slots × 4 u64: generation, size, and where a worker
                              finds the segment: memfd backend: main's descriptor number
                              and the segment's inode; POSIX backend: 0, 0 (the name
                              follows from the prefix, slot and generation)
    K    claims               max_slots u64: the ticket of the request main sent in each
                              slot, until the worker popping it or main moving it swaps it
                              to 0 (poolloader.shm._ring.claim)
    B    ack table            num_workers × max_slots u64: generation mapped by each worker
    S    worker stats         num_workers × 5 u64, written by each worker for itself:
           [0] batches produced  [1] ns producing (fetch + collate + encode)
           [2] ns waiting for a request (idle: no free slot / consumer slow)
           [3] busy stamp: slot being produced and since when (poolloader.worker.stall owns it)
           [4] 1 once it has loaded its start arguments (WORKER_LOADED: main frees them
               when every worker has, PoolLoaderIter._heard in poolloader.main.iterator)
    C    rings                per worker: request ring, done ring (capacity 2 × max_slots
                              each: RING_CELLS_PER_SLOT)
    D    request doorbells    hosts × DOORBELL_BYTES: host h's is rung by main after a push
                              to the request ring of any worker it hosts (worker w is
                              hosted by h = w % hosts: hosted_by)

Main and every worker map all of it, so any of them can overwrite any of it. Each
process therefore keeps the layout (num_workers, max_slots, hosts, every offset,
each ring's capacity) in its own memory: main from its arguments, a worker from the
header it checks once in read_shape. What is read later is checked where it is
read (the rings in csrc/ring.h, the acks and slot table in pool.py) and a bad
value is ControlCorrupt, never an index outside the segment.
"""
from __future__ import annotations

import numpy as np

from poolloader.errors import ControlCorrupt
from poolloader.shm._ring import DOORBELL_BYTES, Doorbell, Ring

CONTROL_MAGIC = 0x6C6F72746E6F434C  # "LControl"
_HEADER_FIELDS = 8
H_MAGIC, H_WORKERS, H_MAX_SLOTS, H_NUM_SLOTS, H_GROWTH, H_MAIN_PID, H_HOSTS, H_RETURNS = range(8)
# H_RETURNS: 1 where a worker gives back the pages of its slot past what its reply
# uses (SlotPool: a memfd pool with no CUDA registration and no private views)
# Cells of every ring per slot: a request ring holds each slot in flight once, and a
# request main moved to another slot (poolloader.main.requests, _move_newest) leaves a
# stale entry ahead of its new one until its worker pops it: never more stale entries
# than live ones behind them.
RING_CELLS_PER_SLOT = 2
# slot table columns (keep in sync with the layout above)
S_GENERATION, S_SIZE, S_HANDLE_A, S_HANDLE_B = range(4)
SLOT_ROW_BYTES = 8 * 4
# worker stats columns (the layout above): the last is WORKER_LOADED
WORKER_STATS = 5
WORKER_LOADED = 4


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def hosted_by(worker: int, hosts: int) -> int:
    """The physical process (0..hosts-1) that hosts logical worker `worker`: round robin,
    so consecutive workers, which DataLoader's round robin hands consecutive batches,
    land in different processes."""
    return worker % hosts


class ControlLayout:
    """Offsets of each block for a given worker count, slot bound and host count."""

    def __init__(self, num_workers: int, max_slots: int, hosts: int = 0):
        self.num_workers = num_workers
        self.max_slots = max_slots
        self.hosts = hosts
        self.doorbell = 64
        self.slot_table = _align(self.doorbell + DOORBELL_BYTES)
        self.claims = _align(self.slot_table + SLOT_ROW_BYTES * max_slots)
        self.ack_table = _align(self.claims + 8 * max_slots)
        self.worker_stats = _align(self.ack_table + 8 * num_workers * max_slots)
        self.rings = _align(self.worker_stats + 8 * WORKER_STATS * num_workers)
        self.ring_capacity = RING_CELLS_PER_SLOT * max_slots
        self.ring_bytes = _align(Ring.nbytes(self.ring_capacity))
        self.request_doorbells = _align(self.rings + 2 * num_workers * self.ring_bytes)
        self.nbytes = _align(self.request_doorbells + hosts * DOORBELL_BYTES, 4096)

    def claim_offset(self, slot: int) -> int:
        """Where slot `slot`'s claim word is (a u64 in `claims`): the ticket of the
        request main sent in it, until someone claims it (poolloader.shm._ring.claim)."""
        return self.claims + 8 * slot

    def request_ring_offset(self, worker: int) -> int:
        return self.rings + 2 * worker * self.ring_bytes

    def done_ring_offset(self, worker: int) -> int:
        return self.rings + (2 * worker + 1) * self.ring_bytes

    def request_doorbell_offset(self, host: int) -> int:
        return self.request_doorbells + host * DOORBELL_BYTES


class Control:
    """Typed views over a mapped control segment.

    `create=True` (main, once) initialises the header, doorbells and rings;
    workers attach with `create=False` after reading num_workers/max_slots/hosts.
    `hosts`: 0, or the number of processes hosting the workers (request_doorbells).
    """

    def __init__(self, mapping, num_workers: int, max_slots: int, create: bool,
                 hosts: int = 0):
        self.layout = lay = ControlLayout(num_workers, max_slots, hosts)
        self.mapping = mapping
        self.header = np.ndarray((_HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0)
        # slot_table[s] = (generation, size in bytes, handle a, handle b) of slot s's
        # current segment (columns S_*)
        self.slot_table = np.ndarray((max_slots, 4), np.uint64, buffer=mapping, offset=lay.slot_table)
        self.claims = np.ndarray((max_slots,), np.uint64, buffer=mapping, offset=lay.claims)
        # acks[w, s] = generation of slot s that worker w has mapped (0: none)
        self.acks = np.ndarray((num_workers, max_slots), np.uint64, buffer=mapping, offset=lay.ack_table)
        # worker_stats[w] = (batches, producing ns, waiting ns, busy stamp, loaded)
        self.worker_stats = np.ndarray((num_workers, WORKER_STATS), np.uint64, buffer=mapping,
                                       offset=lay.worker_stats)
        if create:
            self.header[:] = 0
            self.slot_table[:] = 0
            self.claims[:] = 0
            self.acks[:] = 0
            self.worker_stats[:] = 0
            self.header[H_WORKERS] = num_workers
            self.header[H_MAX_SLOTS] = max_slots
            self.header[H_HOSTS] = hosts
        self.doorbell = Doorbell(mapping, lay.doorbell, create=create)
        # request_doorbells[h]: rung by main after a push to a request ring host h serves
        self.request_doorbells = [Doorbell(mapping, lay.request_doorbell_offset(h), create=create)
                                  for h in range(hosts)]
        self.request_rings = [self._ring(lay.request_ring_offset(w), f"request ring of worker {w}", create)
                              for w in range(num_workers)]
        self.done_rings = [self._ring(lay.done_ring_offset(w), f"done ring of worker {w}", create)
                           for w in range(num_workers)]
        if create:
            self.header[H_MAGIC] = CONTROL_MAGIC

    def _ring(self, offset: int, label: str, create: bool) -> Ring:
        """Create a ring of layout.ring_capacity cells, or attach one and check it has
        that many.

        Each Ring keeps its capacity in the process (csrc/ring.h): after this,
        nothing that is written into its fields can move a read or write."""
        capacity = self.layout.ring_capacity
        if create:
            return Ring(self.mapping, offset, capacity=capacity, label=label)
        try:
            ring = Ring(self.mapping, offset, label=label)
        except ValueError as e:
            raise ControlCorrupt(f"the control block's {e}") from None
        if ring.capacity != capacity:
            raise ControlCorrupt(f"{label} records capacity {ring.capacity}, but the control "
                                 f"block's max_slots is {self.layout.max_slots} "
                                 f"({capacity} cells)")
        return ring

    @staticmethod
    def read_shape(mapping) -> tuple[int, int]:
        """(num_workers, max_slots) of an initialised control segment, checked to fit it.

        Read once, by a process attaching; it keeps them (ControlLayout) and never
        reads them from the segment again."""
        header = np.array(np.ndarray((_HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0))
        if int(header[H_MAGIC]) != CONTROL_MAGIC:
            raise ControlCorrupt(f"the control segment is not initialised (magic "
                                 f"{int(header[H_MAGIC]):#x}, expected {CONTROL_MAGIC:#x})")
        num_workers, max_slots = int(header[H_WORKERS]), int(header[H_MAX_SLOTS])
        size = len(mapping)
        # the ack table alone must fit before the full layout is worth computing
        if not (1 <= num_workers and 1 <= max_slots and 8 * num_workers * max_slots <= size
                and ControlLayout(num_workers, max_slots).nbytes <= size):
            raise ControlCorrupt(f"the control block's header says {num_workers} workers and "
                                 f"max_slots={max_slots}, which do not fit its {size} bytes")
        return num_workers, max_slots

    @staticmethod
    def read_hosts(mapping, num_workers: int, max_slots: int) -> int:
        """The header's host count (0: no request doorbells), checked to fit the segment
        and the worker count; read once, after read_shape, by a process attaching."""
        hosts = int(np.ndarray((_HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0)[H_HOSTS])
        if not (0 <= hosts <= num_workers
                and ControlLayout(num_workers, max_slots, hosts).nbytes <= len(mapping)):
            raise ControlCorrupt(f"the control block's header says {hosts} hosts for "
                                 f"{num_workers} workers, which do not fit its "
                                 f"{len(mapping)} bytes")
        return hosts

    def close_views(self) -> None:
        """Drop every view so the mapping can be unmapped."""
        self.header = self.slot_table = self.claims = self.acks = self.worker_stats = None  # type: ignore[assignment]
        self.doorbell = None  # type: ignore[assignment]
        self.request_doorbells = []
        self.request_rings = self.done_rings = []
