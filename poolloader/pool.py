"""The slot pool: every segment of one loader's pool, main's side and a worker's.

The pool knows nothing about what a slot holds. SlotPool (main) creates the control
block and the slots, grows a slot by replacing its segment with a new generation
(never resizing a mapping in place: a CUDA host registration would not follow it),
detaches a slot's segment for a batch the consumer keeps, and unlinks slot names as
soon as every worker has mapped them (acks in the control block; the control name
stays for the pool's life: it carries the owner lock, see segments.py). WorkerSlots
maps, in a worker, whatever generation each slot has now and acknowledges it.

Everything a worker can write is untrusted here: main keeps its own copies of what
it wrote (generations, the growth counter, slot counts) and checks the ack table
against them; the worker side bounds what it reads by the shape it validated when
it attached (see control.py).
"""
from __future__ import annotations

import os

import numpy as np
import posix_ipc

from poolloader._shm import Mapping
from poolloader.control import H_GROWTH, H_MAIN_PID, H_NUM_SLOTS, Control, ControlLayout
from poolloader.errors import ControlCorrupt
from poolloader.segments import (
    SHM_LIMIT_ENV,
    claim_control,
    control_name,
    create_segment,
    open_segment,
    page_round,
    pool_names,
    release_owner_lock,
    retire,
    shm_free_bytes,
    slot_name,
    space_error,
    sweep_stale,
    unlink_quietly,
)


class SlotPool:
    """Main side: owns every name and segment of one loader's pool.

    `on_map(mapping, slot)` / `on_unmap(mapping, slot)` let the CUDA part register
    each mapping once, at creation, and unregister it before it is unmapped. Only
    main calls this; workers use WorkerSlots.
    """

    def __init__(self, num_workers: int, slots: int, max_slots: int, slot_bytes: int,
                 shm_limit: int | None = None, on_map=None, on_unmap=None):
        if shm_limit is None and os.environ.get(SHM_LIMIT_ENV):
            shm_limit = int(os.environ[SHM_LIMIT_ENV])
        self.shm_limit = shm_limit
        self.num_workers = num_workers
        self.max_slots = max_slots
        self.target_bytes = page_round(slot_bytes)
        self._owner_pid = os.getpid()
        self.prefix = ""  # set once the control segment is claimed
        self._on_map = on_map
        self._on_unmap = on_unmap
        self.mappings: list[Mapping | None] = []
        self.generations: list[int] = []
        self.growth_events = 0
        self._pending: dict[str, tuple[int, int]] = {}  # name -> (slot, generation) awaiting acks
        self._names: set[str] = set()  # every name not yet unlinked
        # set below, and None again only after close(): nothing uses them then
        self.control: Control = None  # type: ignore[assignment]
        self._control_mapping: Mapping = None  # type: ignore[assignment]
        self._control_name = ""
        self._lock_fd: int | None = None  # holds the owner lock: the pool's one descriptor
        self._growth = 0  # main's copy of the growth counter it publishes
        self._closed = False
        sweep_stale()
        try:
            lay = ControlLayout(num_workers, max_slots)
            needed = lay.nbytes + slots * self.target_bytes
            free = shm_free_bytes()
            if needed > free:
                raise space_error(needed, free, f"a pool of {slots} slots of {self.target_bytes} bytes")
            self._claim_control(lay.nbytes)
            self.control = Control(self._control_mapping, num_workers, max_slots, create=True)
            self.control.header[H_MAIN_PID] = os.getpid()
            for _ in range(slots):
                self.add_slot()
        except BaseException:
            self.close()
            raise

    def _claim_control(self, nbytes: int) -> None:
        """Create the control segment under a fresh prefix and hold its owner lock."""
        prefix, mapping, fd = claim_control(self._owner_pid, nbytes, self.shm_limit)
        self.prefix, self._control_name = prefix, control_name(prefix)
        self._control_mapping, self._lock_fd = mapping, fd
        self._names.add(self._control_name)

    # -- sizes ---------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.mappings)

    @property
    def total_bytes(self) -> int:
        return sum(m.size for m in self.mappings if m is not None)

    def size(self, slot: int) -> int:
        mapping = self.mappings[slot]
        return 0 if mapping is None else mapping.size

    # -- changes (main only, while main owns the slot) --------------------------
    def add_slot(self) -> int:
        """Append one slot of the current target size; returns its index."""
        slot = len(self.mappings)
        if slot >= self.max_slots:
            raise ValueError(f"internal error: slot {slot} beyond max_slots={self.max_slots}")
        self.mappings.append(None)
        self.generations.append(0)
        try:
            self._map_new(slot, self.target_bytes)
        except BaseException:
            self.mappings.pop()
            self.generations.pop()
            raise
        self.control.header[H_NUM_SLOTS] = len(self.mappings)
        self._bump()
        return slot

    def replace(self, slot: int, nbytes: int) -> None:
        """Give `slot` a fresh segment of at least `nbytes` (page-rounded).

        Main must own the slot (FREE or just returned by a worker) and hold no
        view of it. Raises the target size so other slots follow lazily.
        """
        nbytes = page_round(nbytes)
        self.target_bytes = max(self.target_bytes, nbytes)
        old = self.mappings[slot]
        if old is not None:
            self.detach(slot)
        try:
            self._map_new(slot, nbytes)
        finally:
            if old is not None:
                try:
                    if self._on_unmap is not None:
                        self._on_unmap(old, slot)
                finally:
                    retire(old)
        self.growth_events += 1
        self._bump()

    def detach(self, slot: int):
        """Take `slot`'s segment out of the pool and return its mapping: its name is
        unlinked and the slot is empty (generation 0: workers skip it) until
        `refill()`. The mapping is the caller's: still mapped (and registered)."""
        old = self.mappings[slot]
        self._pending.pop(slot_name(self.prefix, slot, self.generations[slot]), None)
        self._unlink(slot_name(self.prefix, slot, self.generations[slot]))
        self.mappings[slot] = None
        self.control.slot_table[slot, 0] = 0
        self.control.slot_table[slot, 1] = 0
        self._bump()
        return old

    def refill(self, slot: int) -> None:
        """A fresh segment of the current target size for an empty slot."""
        self._map_new(slot, self.target_bytes)
        self._bump()

    def _map_new(self, slot: int, nbytes: int) -> None:
        generation = self.generations[slot] + 1
        name = slot_name(self.prefix, slot, generation)
        mapping = create_segment(name, nbytes, f"slot {slot} ({nbytes} bytes)",
                                 self.total_bytes + self._control_mapping.size,
                                 self.shm_limit)
        if self._on_map is not None:
            try:
                self._on_map(mapping, slot)
            except BaseException:
                unlink_quietly(name)
                retire(mapping)
                raise
        self._names.add(name)
        self._pending[name] = (slot, generation)
        self.mappings[slot] = mapping
        self.generations[slot] = generation
        self.control.slot_table[slot, 1] = nbytes
        self.control.slot_table[slot, 0] = generation  # last: readers key on it

    def _bump(self) -> None:
        self._growth += 1
        self.control.header[H_GROWTH] = self._growth

    def unmap(self, mapping) -> None:
        """A mapping detached from the pool whose batch is gone: unregister, unmap."""
        try:
            if self._on_unmap is not None:
                self._on_unmap(mapping, None)
        finally:
            retire(mapping)

    def needs_resize(self, slot: int) -> bool:
        mapping = self.mappings[slot]
        return mapping is None or mapping.size < self.target_bytes

    # -- names ---------------------------------------------------------------
    def unlink_mapped(self) -> int:
        """Unlink every slot name that all workers have mapped; returns how many remain.

        Called after each returned slot and on main's wait ticks; a dict check
        when nothing is pending. The control name stays until close(): it carries
        the owner lock (module docstring). Workers write the ack table, so it is
        read once into a local copy and checked against the generations main made:
        ControlCorrupt if a worker claims one that does not exist.
        """
        if not self._pending:
            return 0
        acks = np.array(self.control.acks)  # one read of what workers wrote
        for name, (slot, generation) in list(self._pending.items()):
            acked = acks[:, slot]
            if int(acked.max()) > self.generations[slot]:
                worker = int(acked.argmax())
                raise ControlCorrupt(
                    f"worker {worker} acknowledged generation {int(acked[worker])} of slot {slot}, "
                    f"but main has made only {self.generations[slot]}: the control block's ack "
                    "table was overwritten by a process that maps it (a stray write in code "
                    "running in a worker)")
            if int(acked.min()) >= generation:
                del self._pending[name]
                self._unlink(name)
        return len(self._pending)

    def _unlink(self, name: str) -> None:
        if name in self._names:
            self._names.discard(name)
            unlink_quietly(name)

    @property
    def live_names(self) -> set[str]:
        return set(self._names)

    def close(self) -> None:
        """Unlink every name and drop every mapping. Leased slots stay mapped
        until their last view dies (invariant 3). Idempotent."""
        if self._closed or os.getpid() != self._owner_pid:
            return  # an inherited copy in a forked child owns nothing
        self._closed = True
        # slot names first, the control name last: a sweeper that finds slot names
        # without their control segment leaves them alone
        for name in sorted(self._names, key=lambda name: name == self._control_name):
            unlink_quietly(name)
        self._names.clear()
        self._pending.clear()
        failure = None
        for slot, mapping in enumerate(self.mappings):
            if mapping is not None:
                try:
                    if self._on_unmap is not None:
                        self._on_unmap(mapping, slot)
                except BaseException as e:  # the other slots are unmapped all the same
                    failure = failure or e
                retire(mapping)
        self.mappings = []
        if self.control is not None:
            self.control.close_views()
            self.control = None  # type: ignore[assignment]
        if self._control_mapping is not None:
            retire(self._control_mapping)
            self._control_mapping = None  # type: ignore[assignment]
        if self._lock_fd is not None:
            release_owner_lock(self._lock_fd)  # the names are gone already
            self._lock_fd = None
        if failure is not None:
            raise failure


class WorkerSlots:
    """Worker side: maps the control block and every current slot generation.

    `sync()` maps what changed since last time and acknowledges it in the
    control block, so main can unlink the names; it is cheap when nothing grew.
    Every worker and main can write the control block, so what is read from it is
    bounded by the shape validated at attach (ControlCorrupt otherwise).
    """

    def __init__(self, prefix: str, worker_id: int):
        self.prefix = prefix
        self.worker_id = worker_id
        shm = posix_ipc.SharedMemory(control_name(prefix))
        try:
            mapping = Mapping(shm.fd, shm.size)
        finally:
            shm.close_fd()
        num_workers, max_slots = Control.read_shape(mapping)
        if not 0 <= worker_id < num_workers:
            raise ControlCorrupt(f"worker {worker_id}: the control block says the pool has "
                                 f"{num_workers} workers")
        self.max_slots = max_slots
        self.control = Control(mapping, num_workers, max_slots, create=False)
        self.mappings: dict[int, tuple[int, Mapping]] = {}
        self._seen_growth = -1
        self.sync()

    def sync(self) -> None:
        growth = int(self.control.header[H_GROWTH])
        if growth == self._seen_growth:
            return
        self._seen_growth = growth
        num_slots = int(self.control.header[H_NUM_SLOTS])
        if num_slots > self.max_slots:
            raise ControlCorrupt(f"worker {self.worker_id}: the control block says the pool has "
                                 f"{num_slots} slots, more than its max_slots={self.max_slots}")
        table = self.control.slot_table
        for slot in range(num_slots):
            generation = int(table[slot, 0])
            have = self.mappings.get(slot)
            if generation == 0:  # detached by main, empty until refilled
                if have is not None:
                    del self.mappings[slot]
                continue
            if have is None or have[0] != generation:
                try:
                    mapping = open_segment(slot_name(self.prefix, slot, generation))
                except posix_ipc.ExistentialError:
                    # main replaced it again meanwhile; a later sync maps the newer one
                    self._seen_growth = -1
                    continue
                self.mappings[slot] = (generation, mapping)
                self.control.acks[self.worker_id, slot] = generation

    def mapping(self, slot: int) -> Mapping:
        """The current mapping of a slot this worker owns right now (popped from its ring)."""
        if not 0 <= slot < self.max_slots:
            raise ControlCorrupt(f"worker {self.worker_id} was handed slot {slot}, outside the "
                                 f"pool's 0..{self.max_slots - 1}: its request ring was overwritten")
        generation = int(self.control.slot_table[slot, 0])
        have = self.mappings.get(slot)
        if have is None or have[0] != generation:
            self._seen_growth = -1
            self.sync()
            have = self.mappings.get(slot)
            if have is None or have[0] != generation:
                raise RuntimeError(f"internal error: worker {self.worker_id} cannot map slot {slot} "
                                   f"generation {generation}")
        return have[1]

    def unlink_all(self) -> None:
        """The parent died: remove every name it owned, control block last.

        Found by listing /dev/shm for the prefix, not from the slot table, which
        any process of the pool could have overwritten."""
        for name in pool_names(self.prefix):
            unlink_quietly(name)
