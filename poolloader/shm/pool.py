"""The slot pool: every segment of one loader's pool, main's side and a worker's.

The pool knows nothing about what a slot holds. SlotPool (main) creates the control
block and the slots, grows a slot by replacing its segment with a new generation
(never resizing a mapping in place: a CUDA host registration would not follow it),
detaches a slot's segment for a batch the consumer keeps, and releases what workers
need to find a segment (a memfd's descriptor, a POSIX name) as soon as every worker
has mapped it (acks in the control block). WorkerSlots maps, in a worker, whatever
generation each slot has now, acknowledges it, and drops its mapping of every
segment that is no longer the slot's, so every process maps only live segments.

Where segments live is the backend's (`backend=`), one module in
poolloader.shm.backends behind the interface in poolloader.shm.backend: "memfd"
(backends/memfd.py, the default: anonymous, outside /dev/shm, nothing named) or
"posix" (backends/posix.py: named segments in /dev/shm through posix-ipc, with a sweep
of dead owners' names). Both hand out the same poolloader.shm._shm.Mapping, so nothing
above this module (the codec, the CUDA registration) knows which one is in use, and
nothing here names one: a backend is found by its kind (backends.load).

Private views (`private_views=True`, a share_batches leader: poolloader.main.share):
beside each slot's shared mapping (main's writes, the header, what workers find),
main keeps a copy-on-write mapping of the same segment (`view`), which its batches
are decoded from, so a write to a delivered batch stays in this process.
`renew_view` readies a view for the slot's next batch. The view is what `on_map`
registers with CUDA and what `detach` hands over (the one a batch's lease holds).

Everything a worker can write is untrusted here: main keeps its own copies of what
it wrote (generations, the growth counter, slot counts) and checks the ack table
against them; the worker side bounds what it reads by the shape it validated when
it attached (see control.py).
"""
from __future__ import annotations

import os

import numpy as np

from poolloader.errors import ControlCorrupt, warn
from poolloader.shm import backends
from poolloader.shm._shm import Mapping
from poolloader.shm.backend import MainSide, WorkerSide, cap, check_cap, page_round, retire
from poolloader.shm.control import (
    H_GROWTH,
    H_MAIN_PID,
    H_NUM_SLOTS,
    H_RETURNS,
    S_GENERATION,
    S_HANDLE_A,
    S_HANDLE_B,
    S_SIZE,
    Control,
    ControlLayout,
)

BACKEND_ENV = "POOLLOADER_SHM_BACKEND"
_warned_fallback = False


def choose_backend(requested: str | None, max_slots: int = 0) -> str:
    """The backend a new pool uses: `requested`, else $POOLLOADER_SHM_BACKEND, else the
    first kind of backends.PREFERENCE that does not refuse a pool of `max_slots` here
    (Backend.refuses), with one warning saying why the ones before it refused.

    memfd is the default everywhere it works: it needs no /dev/shm space (Docker's
    default is 64 MiB), names nothing, so a crash leaves nothing, and it is the same
    shmem memory as /dev/shm (same speed, registrable with CUDA). Choosing by free
    space would make the same job name segments on one host and not on another.
    It can need up to one descriptor per slot for a moment, so where RLIMIT_NOFILE
    leaves too few (memfd.refuses), a pool is POSIX."""
    global _warned_fallback
    kind = requested or os.environ.get(BACKEND_ENV) or None
    kinds = backends.kinds()
    if kind is not None and kind not in kinds:
        raise ValueError(f"shm_backend must be one of {kinds}, got {kind!r}"
                         + (f" (from ${BACKEND_ENV})" if not requested else ""))
    refused = []
    for candidate in (kind,) if kind is not None else kinds:
        why_not = backends.load(candidate).refuses(max_slots)
        if why_not is None:
            break
        if kind is not None:
            instead = next((k for k in kinds if k != kind), None)
            raise OSError(f"shm_backend={kind!r} cannot be used here: {why_not}"
                          + (f"; use shm_backend={instead!r}" if instead else ""))
        refused.append(why_not)
    else:
        raise OSError(f"no shared-memory backend of {kinds} can be used here: {'; '.join(refused)}")
    if refused and not _warned_fallback:
        _warned_fallback = True
        warn(f"PoolLoader: this pool uses {backends.load(candidate).DESCRIPTION} "
             f"(shm_backend={candidate!r}): {'; '.join(refused)}")
    return candidate


def attach(locator: tuple) -> WorkerSide:
    """Worker side: the backend attachment for a pool's `locator` (SlotPool.locator)."""
    return backends.load(locator[0]).Attachment(*locator[1:])


def renew(view: Mapping, source: Mapping | None, start: int, end: int) -> None:
    """Ready a private view of a segment for the next batch in it (no Lease of the
    view alive): without a `source`, drop the pages this process copied from `start`
    on, so reads map the segment's pages again; with one (the segment's shared
    mapping: a view registered with CUDA, whose pinned pages must stay), copy
    [start, end) in from it."""
    if source is None:
        view.discard(start, view.size - start)
    else:
        view.pull(source, start, min(end, view.size) - start)


class SlotPool:
    """Main side: owns every segment of one loader's pool.

    `on_map(mapping, slot)` / `on_unmap(mapping, slot)` let the CUDA part register
    each mapping once, at creation, and unregister it before it is unmapped. Only
    main calls this; workers use WorkerSlots. `backend`: see choose_backend.
    """

    def __init__(self, num_workers: int, slots: int, max_slots: int, slot_bytes: int,
                 shm_limit: int | None = None, on_map=None, on_unmap=None,
                 backend: str | None = None, hosts: int = 0, keep_handles: bool = False,
                 private_views: bool = False):
        """`hosts`: 0 (every worker its own process), or the number of processes that
        host the num_workers logical workers (PoolLoader(node_workers=)): the control
        block then has a request doorbell per host (control.py). `keep_handles`: keep
        each segment's release key (a memfd's descriptor) while it is the slot's, not
        only until the workers mapped it: a share_batches leader passes it to its
        followers (`descriptor`). `private_views`: decode from a private mapping of
        each segment (`view`; the module docstring); needs keep_handles."""
        self.keep_handles = keep_handles or private_views
        self.shm_limit = cap(shm_limit)
        self.num_workers = num_workers
        self.max_slots = max_slots
        self.target_bytes = page_round(slot_bytes)
        self._owner_pid = os.getpid()
        kind = choose_backend(backend, max_slots)
        self.segments: MainSide = backends.load(kind).Segments(self._owner_pid)
        self._on_map = on_map
        self._on_unmap = on_unmap
        self.mappings: list[Mapping | None] = []
        # private_views: each slot's copy-on-write mapping of the same segment
        self.views: list[Mapping | None] | None = [] if private_views else None
        self.generations: list[int] = []
        self.growth_events = 0
        # release key (name or descriptor) -> (slot, generation) awaiting acks
        self._pending: dict = {}
        self._keys: list = []  # each slot's current segment's release key (None: released)
        # set below, and None again only after close(): nothing uses them then
        self.control: Control = None  # type: ignore[assignment]
        self._control_mapping: Mapping = None  # type: ignore[assignment]
        self._growth = 0  # main's copy of the growth counter it publishes
        self._closed = False
        try:
            lay = ControlLayout(num_workers, max_slots, hosts)
            self._check_cap(lay.nbytes + slots * self.target_bytes, 0,
                            f"a pool of {slots} slots of {self.target_bytes} bytes")
            self.segments.check_space(lay.nbytes + slots * self.target_bytes,
                                      f"a pool of {slots} slots of {self.target_bytes} bytes")
            self._control_mapping = self.segments.claim_control(lay.nbytes)
            self.control = Control(self._control_mapping, num_workers, max_slots, create=True,
                                   hosts=hosts)
            self.control.header[H_MAIN_PID] = os.getpid()
            # pages charged as written, and nothing that must keep them
            # (poolloader.wire.slot_format.return_tail)
            self.control.header[H_RETURNS] = int(self.segments.charged_as_written
                                                 and on_map is None and not private_views)
            for _ in range(slots):
                self.add_slot()
        except BaseException:
            self.close()
            raise

    @property
    def backend(self) -> str:
        return self.segments.kind

    @property
    def locator(self) -> tuple:
        """What a worker needs to attach to this pool (picklable; WorkerSlots)."""
        return self.segments.locator

    @property
    def prefix(self) -> str | None:
        """The POSIX backend's name prefix in /dev/shm; None for memfd (no names)."""
        return getattr(self.segments, "prefix", None)

    def _check_cap(self, nbytes: int, pool_bytes: int, what: str) -> None:
        check_cap(self.shm_limit, nbytes, pool_bytes, what)

    # -- sizes ---------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.mappings)

    @property
    def total_bytes(self) -> int:
        return sum(m.size for m in self.mappings if m is not None)

    def resident_bytes(self) -> int:
        """Bytes of the slots' segments whose pages exist now (written by a batch and
        not returned since: what a memory cgroup is charged for them), out of
        total_bytes reserved. O(pages): for reports, never per batch."""
        return sum(m.resident_bytes() for m in self.mappings if m is not None)

    @property
    def is_open(self) -> bool:
        """Slots are mapped and the control block is there (not closed yet)."""
        return bool(self.mappings) and self.control is not None

    @property
    def largest_slot_bytes(self) -> int:
        return max((m.size for m in self.mappings if m is not None), default=0)

    def worker_counter(self, column: int) -> int:
        """One column of the workers' counters, summed over workers (0 batches, 1 busy
        ns, 2 idle ns; control.py's worker stats table); 0 once closed."""
        return 0 if self.control is None else int(self.control.worker_stats[:, column].sum())

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
        if self.views is not None:
            self.views.append(None)
        self.generations.append(0)
        self._keys.append(None)
        try:
            self._map_new(slot, self.target_bytes)
        except BaseException:
            self.mappings.pop()
            if self.views is not None:
                self.views.pop()
            self.generations.pop()
            self._keys.pop()
            raise
        self.control.header[H_NUM_SLOTS] = len(self.mappings)
        self._bump()
        return slot

    def replace(self, slot: int, nbytes: int, written: int | None = None) -> None:
        """Give `slot` a fresh segment of at least `nbytes` (page-rounded).

        Main must own the slot (FREE or just returned by a worker) and hold no
        view of it. Raises the target size so other slots follow lazily.
        `written`: the bytes its first writer will write, where known (a worker's
        growth request), which is what a backend that charges pages as written
        checks the memory available for (MainSide.create).
        """
        nbytes = page_round(nbytes)
        self.target_bytes = max(self.target_bytes, nbytes)
        old = self.detach(slot) if self.mappings[slot] is not None else None
        try:
            self._map_new(slot, nbytes, written)
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
        """Take `slot`'s segment out of the pool and return its mapping: what workers
        would find it by is released and the slot is empty (generation 0: workers drop
        their mapping of it at their next sync) until `refill()`. The mapping is the
        caller's: still mapped (and registered). With private views, that is the
        slot's view (what its batches view, what on_map registered); the shared
        mapping is dropped here."""
        old = self.mappings[slot]
        if self.views is not None:
            shared, old = old, self.views[slot]
            self.views[slot] = None
            if shared is not None:
                retire(shared)
        key = self._keys[slot]
        if key is not None:
            self._pending.pop(key, None)
            self.segments.release(key)
            self._keys[slot] = None
        self.mappings[slot] = None
        self.control.slot_table[slot] = 0  # generation first of all: readers key on it
        self._bump()
        return old

    def refill(self, slot: int) -> None:
        """A fresh segment of the current target size for an empty slot."""
        self._map_new(slot, self.target_bytes)
        self._bump()

    def _map_new(self, slot: int, nbytes: int, written: int | None = None) -> None:
        what = f"slot {slot} ({nbytes} bytes)"
        self._check_cap(nbytes, self.total_bytes + self._control_mapping.size, what)
        generation = self.generations[slot] + 1
        mapping, a, b, key = self.segments.create(slot, generation, nbytes, what, written)
        view = None
        try:
            if self.views is not None:
                view = self._private_view(mapping, key)
            if self._on_map is not None:
                self._on_map(mapping if view is None else view, slot)
        except BaseException:
            self.segments.release(key)
            retire(mapping)
            if view is not None:
                retire(view)
            raise
        if self.views is not None:
            self.views[slot] = view
        self._pending[key] = (slot, generation)
        self._keys[slot] = key
        self.mappings[slot] = mapping
        self.generations[slot] = generation
        row = self.control.slot_table[slot]
        row[S_SIZE], row[S_HANDLE_A], row[S_HANDLE_B] = nbytes, a, b
        row[S_GENERATION] = generation  # last: readers key on it

    def _private_view(self, mapping: Mapping, key) -> Mapping:
        """A copy-on-write mapping of `mapping`'s segment. To be registered with CUDA
        (on_map), every page is made this process's own first (`pull`): a pin of a
        private page that is still the segment's would break copy-on-write at the
        pin, or leave the device reading the segment's page once a write copies it
        (docs/node.md, share_batches, "On CUDA"); its pages then stay the ones pinned
        (renew_view copies each batch into them)."""
        if not isinstance(key, int):
            raise RuntimeError(f"internal error: a private view needs a segment descriptor, got "
                               f"{key!r}")
        view = Mapping(key, mapping.size, True, True)
        if self._on_map is not None:
            view.pull(mapping, 0, mapping.size)
        return view

    def view(self, slot: int) -> Mapping | None:
        """The mapping `slot`'s batches are decoded from: its private view, else its
        shared mapping."""
        return self.mappings[slot] if self.views is None else self.views[slot]

    def renew_view(self, slot: int, start: int, end: int) -> None:
        """Before a new batch in `slot` is decoded from its view (main owns the slot
        and no lease of it is alive): the bytes of [start, end) are the segment's
        now. An unregistered view drops the pages this process copied from `start`
        on (the next read maps the segment's); a registered one copies [start, end)
        in, its pinned pages kept. No-op without private views."""
        if self.views is None:
            return
        view, shared = self.views[slot], self.mappings[slot]
        if view is None or shared is None:
            raise RuntimeError(f"internal error: slot {slot} has no segment to renew")
        renew(view, shared if self._on_map is not None else None, start, end)

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

    def descriptor(self, slot: int) -> int:
        """The memfd descriptor of `slot`'s segment (a pool with keep_handles)."""
        key = self._keys[slot]
        if not self.keep_handles or not isinstance(key, int):
            raise RuntimeError(f"internal error: slot {slot} keeps no descriptor")
        return key

    def return_pages(self, slot: int, start: int) -> bool:
        """Give back the pages of `slot`'s segment from `start` (page-aligned) on:
        punched out of the segment in every process that maps it, charged anew when
        a batch writes there again. Main must own the slot (FREE) and hold no view
        of it. Refused (False) where pages must stay: a mapping registered with CUDA
        (a pinned page would stay the device's while the segment got a new one), a
        share_batches leader's (its private views map the segment's pages), or one
        a forked child may still read; and where segments are reserved whole (POSIX: a
        hole in a /dev/shm file could SIGBUS its next writer once /dev/shm is full)."""
        mapping = self.mappings[slot]
        if (mapping is None or not self.segments.charged_as_written
                or self._on_map is not None or self.views is not None
                or mapping.forked or mapping.leases or start >= mapping.size):
            return False
        mapping.return_pages(start, mapping.size - start)
        return True

    def needs_resize(self, slot: int) -> bool:
        mapping = self.mappings[slot]
        return mapping is None or mapping.size < self.target_bytes

    # -- what workers find segments by ------------------------------------------
    def unlink_mapped(self) -> int:
        """Release (unlink a name, close a descriptor) every segment all workers have
        mapped; returns how many remain.

        Called after each returned slot and on main's wait ticks; a dict check
        when nothing is pending. Workers write the ack table, so it is read once
        into a local copy and checked against the generations main made:
        ControlCorrupt if a worker claims one that does not exist.
        """
        if not self._pending:
            return 0
        acks = np.array(self.control.acks)  # one read of what workers wrote
        for key, (slot, generation) in list(self._pending.items()):
            acked = acks[:, slot]
            if int(acked.max()) > self.generations[slot]:
                worker = int(acked.argmax())
                raise ControlCorrupt(
                    f"worker {worker} acknowledged generation {int(acked[worker])} of slot {slot}, "
                    f"but main has made only {self.generations[slot]}: the control block's ack "
                    "table was overwritten by a process that maps it (a stray write in code "
                    "running in a worker)")
            if int(acked.min()) >= generation:
                del self._pending[key]
                if self.keep_handles:
                    continue  # released when the slot's segment changes (detach)
                if self._keys[slot] == key:
                    self._keys[slot] = None
                self.segments.release(key)
        return len(self._pending)

    @property
    def live_names(self) -> set:
        """POSIX: every name of the pool still in /dev/shm; memfd: the descriptors main
        still holds for workers to open (empty in steady state)."""
        return self.segments.live_handles

    def close(self) -> None:
        """Release every name and descriptor and drop every mapping. Leased slots stay
        mapped until their last view dies (invariant 3). Idempotent."""
        if self._closed or os.getpid() != self._owner_pid:
            return  # an inherited copy in a forked child owns nothing
        self._closed = True
        self._pending.clear()
        failure = None
        try:
            self.segments.close()
        except BaseException as e:
            failure = e
        for slot, mapping in enumerate(self.mappings):
            if mapping is not None:
                view = self.views[slot] if self.views is not None else None
                try:
                    if self._on_unmap is not None:
                        self._on_unmap(mapping if view is None else view, slot)
                except BaseException as e:  # the other slots are unmapped all the same
                    failure = failure or e
                retire(mapping)
                if view is not None:
                    retire(view)
        self.mappings = []
        if self.views is not None:
            self.views = []
        if self.control is not None:
            self.control.close_views()
            self.control = None  # type: ignore[assignment]
        if self._control_mapping is not None:
            retire(self._control_mapping)
            self._control_mapping = None  # type: ignore[assignment]
        if failure is not None:
            raise failure


class WorkerSlots:
    """Worker side: maps the control block and every current slot generation.

    `sync()` maps what changed since last time, acknowledges it in the control block
    (so main can release it), and drops this worker's mapping of every segment that
    is no longer its slot's; it is cheap when nothing grew. Every worker and main can
    write the control block, so what is read from it is bounded by the shape
    validated at attach (ControlCorrupt otherwise).
    """

    def __init__(self, locator: tuple, worker_id: int, hosted: tuple[int, ...] | None = None):
        """`hosted`: every logical worker this process hosts (worker_id first), whose
        acks it writes; None: worker_id alone."""
        self.worker_id = worker_id
        self.hosted = (worker_id,) if hosted is None else tuple(hosted)
        self.attachment = attach(locator)
        mapping = self.attachment.control_mapping
        num_workers, max_slots = Control.read_shape(mapping)
        for worker in (worker_id, *self.hosted):
            if not 0 <= worker < num_workers:
                raise ControlCorrupt(f"worker {worker}: the control block says the pool has "
                                     f"{num_workers} workers")
        self.max_slots = max_slots
        self.control = Control(mapping, num_workers, max_slots, create=False,
                               hosts=Control.read_hosts(mapping, num_workers, max_slots))
        # whether this worker gives back its slot's pages past each reply (H_RETURNS)
        self.returns_tail = bool(self.control.header[H_RETURNS])
        self.mappings: dict[int, tuple[int, Mapping]] = {}
        self.dropped = False  # a sync dropped a mapping since the caller last looked
        self._seen_growth = -1
        self.sync()

    def owner_alive(self) -> bool:
        """Whether main (the pool's owner) still lives: its owner lock (poolloader.shm.backend)."""
        return self.attachment.owner_alive()

    is_alive = owner_alive  # what poolloader.worker.popen.parent_process_through asks
    def sync(self) -> None:
        """Map what changed. Sets `dropped` if a slot's mapping was dropped or replaced
        (the caller then drops what it caches per mapping: SlotWriter.forget_stale)."""
        growth = int(self.control.header[H_GROWTH])
        if growth == self._seen_growth:
            return
        self._seen_growth = growth
        num_slots = int(self.control.header[H_NUM_SLOTS])
        if num_slots > self.max_slots:
            raise ControlCorrupt(f"worker {self.worker_id}: the control block says the pool has "
                                 f"{num_slots} slots, more than its max_slots={self.max_slots}")
        table = self.control.slot_table
        for slot in list(self.mappings):
            if slot >= num_slots:
                del self.mappings[slot]
                self.dropped = True
        for slot in range(num_slots):
            row = np.array(table[slot])  # one read; main may rewrite it meanwhile
            generation = int(row[S_GENERATION])
            have = self.mappings.get(slot)
            if generation == 0:  # detached by main, empty until refilled
                if have is not None:
                    del self.mappings[slot]
                    self.dropped = True
                continue
            if have is None or have[0] != generation:
                if have is not None:
                    del self.mappings[slot]  # that segment is no longer this slot's
                    self.dropped = True
                mapping = self.attachment.open_slot(slot, generation, int(row[S_SIZE]),
                                                    int(row[S_HANDLE_A]), int(row[S_HANDLE_B]))
                if mapping is None or int(table[slot, S_GENERATION]) != generation:
                    # main replaced it again meanwhile; a later sync maps the newer one
                    self._seen_growth = -1
                    continue
                self.mappings[slot] = (generation, mapping)
                for worker in self.hosted:
                    self.control.acks[worker, slot] = generation

    def mapping(self, slot: int) -> Mapping:
        """The current mapping of a slot this worker owns right now (popped from its ring)."""
        if not 0 <= slot < self.max_slots:
            raise ControlCorrupt(f"worker {self.worker_id} was handed slot {slot}, outside the "
                                 f"pool's 0..{self.max_slots - 1}: its request ring was overwritten")
        generation = int(self.control.slot_table[slot, S_GENERATION])
        have = self.mappings.get(slot)
        if have is None or have[0] != generation:
            self._seen_growth = -1
            self.sync()
            have = self.mappings.get(slot)
            if have is None or have[0] != generation:
                raise RuntimeError(f"internal error: worker {self.worker_id} cannot map slot {slot} "
                                   f"generation {generation}")
        return have[1]

    def current(self) -> set[int]:
        """ids of the mappings this worker holds as current (SlotWriter.forget_stale)."""
        return {id(m) for _, m in self.mappings.values()}

    def close(self) -> None:
        """Leave the pool while this process goes on (a node pool's process, when the
        rank's iterator ends or the rank dies): its mappings are dropped with this
        object; its descriptor of the control segment is closed now."""
        self.mappings = {}
        self.control.close_views()
        self.attachment.close()
        self.attachment.control_mapping = None  # type: ignore[assignment]

    def unlink_all(self) -> None:
        """The parent died: remove whatever it left that outlives processes (POSIX names;
        nothing for memfd)."""
        self.attachment.orphaned()
