"""Shared-memory segments: create, map, name, replace, unlink, sweep.

The pool knows nothing about what a slot holds. Every segment is created
exclusively (O_EXCL) with mode 0600 under a name carrying the owner's pid and a
random token, mapped once per process with the descriptor closed right after
(poolloader._shm.Mapping keeps none), and unlinked as soon as every worker has
mapped it (acks in the control block). Growth replaces a slot's segment with a
new generation, never resizes a mapping in place (a CUDA host registration
would not follow it).

Names: /pl-<owner pid>-<token>-ctl for the control block and
/pl-<owner pid>-<token>-s<slot>-g<generation> for slots.

Main's segments are mapped with MADV_DONTFORK, so a child forked later (any
loader's workers) does not inherit them, but it does inherit the Python objects
that point at them; every teardown path here and in the iterator does nothing
in a process other than the one that made the pool.
"""
from __future__ import annotations

import errno
import os
import re
import secrets

import posix_ipc

from poolloader._shm import Mapping
from poolloader.control import H_GROWTH, H_MAIN_PID, H_NUM_SLOTS, Control, ControlLayout
from poolloader.errors import ShmSpaceError

PAGE = os.sysconf("SC_PAGE_SIZE")
SHM_DIR = "/dev/shm"
SHM_LIMIT_ENV = "POOLLOADER_SHM_LIMIT"
_NAME_RE = re.compile(r"^pl-(\d+)-([0-9a-f]+)-")
def page_round(nbytes: int) -> int:
    return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)


def control_name(prefix: str) -> str:
    return f"{prefix}-ctl"


def slot_name(prefix: str, slot: int, generation: int) -> str:
    return f"{prefix}-s{slot}-g{generation}"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink poolloader names whose owner process no longer exists; return them."""
    removed = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        m = _NAME_RE.match(entry)
        if m and not _pid_alive(int(m.group(1))):
            try:
                posix_ipc.unlink_shared_memory("/" + entry)
                removed.append(entry)
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                pass
    return removed


def unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def create_segment(name: str, nbytes: int, what: str, pool_bytes: int, limit: int | None,
                   dontfork: bool = True) -> Mapping:
    """Create, reserve and map `nbytes` under `name`; the name stays until unlinked.

    Checks free space in /dev/shm and the optional cap first, then reserves the
    pages with posix_fallocate: on tmpfs an unreserved segment would be created
    fine and kill its first writer with SIGBUS once the space runs out.
    """
    free = shm_free_bytes()
    if limit is not None and pool_bytes + nbytes > limit:
        raise ShmSpaceError(
            f"poolloader needs {nbytes} more bytes of shared memory for {what}, which would "
            f"bring the pool to {pool_bytes + nbytes} bytes, over the cap of {limit} bytes "
            f"(shm_limit= or ${SHM_LIMIT_ENV}); {free} bytes are free in {SHM_DIR}. "
            "Raise the cap, or lower slot_bytes, prefetch_factor or num_workers.")
    if nbytes > free:
        raise _space_error(nbytes, free, what)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
    try:
        try:
            os.posix_fallocate(shm.fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise _space_error(nbytes, shm_free_bytes(), what) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        return Mapping(shm.fd, nbytes, dontfork)
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()


def open_segment(name: str) -> Mapping:
    """Map all of an existing segment by name (worker side); the descriptor is closed at once.

    The size comes from the segment itself, not from the control block: main may be
    rewriting a slot's table row while a worker reads it.
    """
    shm = posix_ipc.SharedMemory(name)
    try:
        return Mapping(shm.fd, shm.size)
    finally:
        shm.close_fd()


def _space_error(nbytes: int, free: int, what: str) -> ShmSpaceError:
    return ShmSpaceError(
        f"poolloader needs {nbytes} bytes of {SHM_DIR} for {what}, but only {free} bytes are "
        f"free. Enlarge {SHM_DIR} (Docker: --shm-size=2g or larger; Kubernetes: an emptyDir "
        "with medium: Memory), or lower slot_bytes, prefetch_factor or num_workers.")


def retire(mapping) -> None:
    """Unmap now if nothing views the mapping; otherwise its last view unmaps it."""
    try:
        mapping.close()
    except BufferError:
        pass


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
        self.prefix = f"/pl-{self._owner_pid}-{secrets.token_hex(8)}"
        self._on_map = on_map
        self._on_unmap = on_unmap
        self.mappings: list[Mapping | None] = []
        self.generations: list[int] = []
        self.growth_events = 0
        self._pending: dict[str, tuple[int, int]] = {}  # name -> (slot, generation) awaiting acks
        self._names: set[str] = set()  # every name not yet unlinked
        self.control: Control | None = None
        self._control_mapping = None
        self._closed = False
        sweep_stale()
        try:
            lay = ControlLayout(num_workers, max_slots)
            name = control_name(self.prefix)
            needed = lay.nbytes + slots * self.target_bytes
            free = shm_free_bytes()
            if needed > free:
                raise _space_error(needed, free, f"a pool of {slots} slots of {self.target_bytes} bytes")
            self._control_mapping = create_segment(name, lay.nbytes, "the control block", 0, shm_limit)
            self._names.add(name)
            self._control_name = name
            self.control = Control(self._control_mapping, num_workers, max_slots, create=True)
            self.control.header[H_MAIN_PID] = os.getpid()
            for _ in range(slots):
                self.add_slot()
        except BaseException:
            self.close()
            raise

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
        self.control.header[H_GROWTH] = int(self.control.header[H_GROWTH]) + 1

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
        """Unlink every name that all workers have mapped; returns how many remain.

        Called after each returned slot and on main's wait ticks; a dict check
        when nothing is pending.
        """
        if not self._pending:
            return 0
        acks = self.control.acks
        for name, (slot, generation) in list(self._pending.items()):
            if int(acks[:, slot].min()) >= generation:
                del self._pending[name]
                self._unlink(name)
        if not self._pending:
            # every worker acknowledged a slot, so it attached the control block first
            self._unlink(self._control_name)
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
        for name in list(self._names):
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
            self.control = None
        if self._control_mapping is not None:
            retire(self._control_mapping)
            self._control_mapping = None
        if failure is not None:
            raise failure


class WorkerSlots:
    """Worker side: maps the control block and every current slot generation.

    `sync()` maps what changed since last time and acknowledges it in the
    control block, so main can unlink the names; it is cheap when nothing grew.
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
        self.control = Control(mapping, num_workers, max_slots, create=False)
        self.mappings: dict[int, tuple[int, Mapping]] = {}
        self._seen_growth = -1
        self.sync()

    def sync(self) -> None:
        growth = int(self.control.header[H_GROWTH])
        if growth == self._seen_growth:
            return
        self._seen_growth = growth
        table = self.control.slot_table
        for slot in range(int(self.control.header[H_NUM_SLOTS])):
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
        """The parent died: remove every name it owned (control block included)."""
        table = self.control.slot_table
        for slot in range(int(self.control.header[H_NUM_SLOTS])):
            if int(table[slot, 0]):
                unlink_quietly(slot_name(self.prefix, slot, int(table[slot, 0])))
        unlink_quietly(control_name(self.prefix))

