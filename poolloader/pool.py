"""Shared-memory segments: create, map, name, replace, unlink, sweep; who owns them.

The pool knows nothing about what a slot holds. Every segment is created
exclusively (O_EXCL) with mode 0600 under a name carrying the owner's pid and a
random token, mapped once per process with the descriptor closed right after
(poolloader._shm.Mapping keeps none), and slot names are unlinked as soon as every
worker has mapped them (acks in the control block). Growth replaces a slot's
segment with a new generation, never resizes a mapping in place (a CUDA host
registration would not follow it).

Names: /pl2-<owner pid>-<token>-ctl for the control block and
/pl2-<owner pid>-<token>-s<slot>-g<generation> for slots. The pid is only a hint
for people reading /dev/shm: nothing here decides anything by it. "pl2" marks
pools that hold an owner lock (below); the "pl-" names of an older poolloader,
whose sweep judges by pid, are neither judged here nor matched by its sweep, so
two versions sharing a host leave each other alone.

Ownership across jobs. /dev/shm is shared by every process on the host and often
by several containers (docker --ipc=host, a pod's memory volume), each with its
own PID namespace, so a pid in a name cannot say whether the owner lives: it may
belong to another namespace, or have been reused. The owner's liveness is an open
file description lock instead: main takes a write lock over its control segment
(fcntl F_OFD_SETLK) when it creates it and holds it, on the one descriptor it
keeps per pool, until close(). The kernel drops it when that descriptor closes,
however the process ends (SIGKILL included), and every process that shares the
tmpfs sees it, whatever its PID namespace, because it lives on the inode.

* sweep_stale() (each new pool runs it) removes a pool's names only after taking
  that lock itself, which proves the owner gone: slot names first, the control
  name last, while holding it. Names whose control segment is absent are left
  alone: a pool made here creates its control name first and removes it last,
  so nothing says whose such names are (an older poolloader's, say).
* OwnerProbe, the workers' parent-death check, asks the kernel whether the lock
  is still held (F_OFD_GETLK) on the worker's own descriptor of the same inode:
  exact under fork, spawn and forkserver (a dead forkserver says nothing about
  main), and pid reuse cannot fool it.
* So the control name stays for the pool's whole life (slot names still go as
  soon as every worker has mapped them), and a child that os.fork() makes in
  main closes its inherited copy of the lock's descriptor at once (an at-fork
  hook; exec closes it too): a long-lived child must not keep a dead main's pool
  "alive". A raw C fork() without exec would keep it until that child exits.
* Between creating its control segment and locking it a new owner is exposed
  for a moment; it checks afterwards that it holds the lock and that the name
  still leads to its inode, and otherwise starts over under a new token.

Weighed and not taken (issue 13): names carrying the PID namespace's identity,
with each namespace sweeping only its own, still judge by pid inside it (reuse)
and never reclaim a dead job's names from another namespace; DALI's way (unlink
at once, descriptors passed with SCM_RIGHTS) needs no sweep, but needs a
descriptor channel to every worker for every slot growth, and says nothing about
parent death. The lock costs one descriptor per pool in main (constant in
workers, batches and tensors) and one fcntl per idle worker tick.

Everything a worker can write is untrusted here: main keeps its own copies of
what it wrote (generations, the growth counter, slot counts) and checks the ack
table against them; the worker side bounds what it reads by the shape it
validated when it attached (see control.py).

Main's segments are mapped with MADV_DONTFORK, so a child forked later (any
loader's workers) does not inherit them, but it does inherit the Python objects
that point at them; every teardown path here and in the iterator does nothing
in a process other than the one that made the pool.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets

import numpy as np
import posix_ipc

from poolloader._shm import Mapping
from poolloader.control import H_GROWTH, H_MAIN_PID, H_NUM_SLOTS, Control, ControlLayout
from poolloader.errors import ControlCorrupt, ShmSpaceError

PAGE = os.sysconf("SC_PAGE_SIZE")
SHM_DIR = "/dev/shm"
SHM_LIMIT_ENV = "POOLLOADER_SHM_LIMIT"
NAME_TAG = "pl2"  # first part of every name (module docstring)
_POOL_RE = re.compile(rf"^({NAME_TAG}-\d+-[0-9a-f]+)-")  # group 1: a pool's prefix, without "/"
# How many fresh tokens a new pool tries when a sweeper races its control segment.
_CLAIM_TRIES = 8


def page_round(nbytes: int) -> int:
    return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)


def control_name(prefix: str) -> str:
    return f"{prefix}-ctl"


def slot_name(prefix: str, slot: int, generation: int) -> str:
    return f"{prefix}-s{slot}-g{generation}"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


# -- the owner lock ------------------------------------------------------------------

class _Flock(ctypes.Structure):
    """struct flock as Linux's F_OFD_* commands read it (64-bit offsets)."""
    _fields_ = [("l_type", ctypes.c_short), ("l_whence", ctypes.c_short),
                ("l_start", ctypes.c_int64), ("l_len", ctypes.c_int64), ("l_pid", ctypes.c_int)]


def _ofd_lock(fd: int, command: int) -> _Flock:
    """A write lock over the whole file: set it (F_OFD_SETLK) or test for one (F_OFD_GETLK)."""
    request = _Flock(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    return _Flock.from_buffer_copy(fcntl.fcntl(fd, command, bytes(request)))


def _take_owner_lock(fd: int) -> bool:
    """Take the owner lock on `fd`'s open file description; False if someone holds it."""
    try:
        _ofd_lock(fd, fcntl.F_OFD_SETLK)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if e.errno == errno.EINVAL:
            raise OSError(e.errno, "poolloader needs open file description locks (fcntl "
                          "F_OFD_SETLK, Linux 3.15 or later) on /dev/shm") from None
        raise
    return True


def _owner_lock_held(fd: int) -> bool:
    """Whether another open file description holds a lock on `fd`'s file."""
    return _ofd_lock(fd, fcntl.F_OFD_GETLK).l_type != fcntl.F_UNLCK


_held_lock_fds: set[int] = set()  # owner-lock descriptors of this process's live pools


def _close_inherited_locks() -> None:
    # In a child of os.fork(): main's locks are main's, not this child's to keep alive.
    for fd in _held_lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_lock_fds.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class _NameLost(Exception):
    """A sweeper took a new control segment's name before its owner could lock it."""


class OwnerProbe:
    """Worker side: whether the owner of a pool still lives.

    Opens the pool's control segment by name once and keeps that descriptor (one
    per worker); is_alive() is one fcntl asking whether main's owner lock is still
    held (see the module docstring). If the control name is already gone, the
    owner closed the pool or died and was swept: is_alive() is False.
    """

    def __init__(self, prefix: str):
        try:
            shm = posix_ipc.SharedMemory(control_name(prefix))
        except posix_ipc.ExistentialError:
            self._fd = None
        else:
            self._fd = shm.fd

    def is_alive(self) -> bool:
        return self._fd is not None and _owner_lock_held(self._fd)


def _pool_names(prefix: str) -> list[str]:
    """Every name in /dev/shm of the pool `prefix`, slot names before the control name."""
    stem = prefix.lstrip("/") + "-"
    try:
        names = ["/" + entry for entry in os.listdir(SHM_DIR) if entry.startswith(stem)]
    except OSError:
        return []
    return sorted(names, key=lambda name: name == control_name(prefix))


def sweep_stale() -> list[str]:
    """Unlink the names of every pool whose owner is gone; return them (without "/").

    Only names under a control segment whose owner lock this call could take go;
    see the module docstring. One open and one fcntl per pool found in /dev/shm.
    """
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    prefixes = {"/" + m.group(1) for m in map(_POOL_RE.match, entries) if m}
    removed = []
    for prefix in sorted(prefixes):
        removed += _sweep_pool(prefix)
    return [name.lstrip("/") for name in removed]


def _sweep_pool(prefix: str) -> list[str]:
    try:
        shm = posix_ipc.SharedMemory(control_name(prefix))
    except posix_ipc.ExistentialError:
        return []  # no control segment: nothing says whose these names are
    except posix_ipc.PermissionsError:
        return []  # another user's pool: not ours to judge
    try:
        if not _take_owner_lock(shm.fd):
            return []  # its owner lives (or another sweeper is at it)
        removed = []
        for name in _pool_names(prefix):  # listed again under the lock: all of them
            try:
                posix_ipc.unlink_shared_memory(name)
                removed.append(name)
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                pass
        return removed
    finally:
        shm.close_fd()  # drops our lock


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
    mapping, _ = _create(name, nbytes, what, pool_bytes, limit, dontfork, claim=False)
    return mapping


def _create(name: str, nbytes: int, what: str, pool_bytes: int, limit: int | None,
            dontfork: bool, claim: bool) -> tuple[Mapping, int | None]:
    """create_segment; with `claim`, also take the owner lock and return the locked
    descriptor (the caller keeps it), or raise _NameLost if a sweeper got there first."""
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
    keep_fd = False
    try:
        # A sweeper may have opened the name before we locked it: then it holds the
        # lock (we fail to take it) or has already unlinked the name.
        if claim and not (_take_owner_lock(shm.fd) and _same_file(SHM_DIR + name, shm.fd)):
            raise _NameLost(name)
        try:
            os.posix_fallocate(shm.fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise _space_error(nbytes, shm_free_bytes(), what) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        mapping = Mapping(shm.fd, nbytes, dontfork)
        keep_fd = claim
        return mapping, (shm.fd if claim else None)
    except BaseException:
        unlink_quietly(name)  # ours alone (random token), if a sweeper left it
        raise
    finally:
        if not keep_fd:
            shm.close_fd()


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


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
        self.prefix = ""  # set once the control segment is claimed
        self._on_map = on_map
        self._on_unmap = on_unmap
        self.mappings: list[Mapping | None] = []
        self.generations: list[int] = []
        self.growth_events = 0
        self._pending: dict[str, tuple[int, int]] = {}  # name -> (slot, generation) awaiting acks
        self._names: set[str] = set()  # every name not yet unlinked
        self.control: Control | None = None
        self._control_mapping: Mapping | None = None
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
                raise _space_error(needed, free, f"a pool of {slots} slots of {self.target_bytes} bytes")
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
        for _ in range(_CLAIM_TRIES):
            prefix = f"/{NAME_TAG}-{self._owner_pid}-{secrets.token_hex(8)}"
            name = control_name(prefix)
            try:
                mapping, fd = _create(name, nbytes, "the control block", 0, self.shm_limit,
                                      dontfork=True, claim=True)
            except _NameLost:
                continue
            assert fd is not None
            self.prefix, self._control_name = prefix, name
            self._control_mapping, self._lock_fd = mapping, fd
            _held_lock_fds.add(fd)
            self._names.add(name)
            return
        raise RuntimeError(f"internal error: {_CLAIM_TRIES} new control segments in a row were "
                           "unlinked by other processes before this one could lock them")

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
            self.control = None
        if self._control_mapping is not None:
            retire(self._control_mapping)
            self._control_mapping = None
        if self._lock_fd is not None:
            _held_lock_fds.discard(self._lock_fd)
            os.close(self._lock_fd)  # drops the owner lock: the names are gone already
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
        for name in _pool_names(self.prefix):
            unlink_quietly(name)
