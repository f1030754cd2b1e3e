"""Shared-memory segments: names, creation, mapping, space checks, and who owns them.

Every segment is created exclusively (O_EXCL) with mode 0600 under a name carrying
the owner's pid and a random token, space-checked and reserved (posix_fallocate),
and mapped with the descriptor closed right after (poolloader.shm._shm.Mapping keeps
none). SlotPool (pool.py) decides which segments a pool has; this module knows how
one is made, named, found, judged stale and removed.
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
* The workers' parent-death check (`owner_alive`) asks the kernel whether the lock
  is still held (F_OFD_GETLK) on the worker's own descriptor of the same inode:
  exact under fork, spawn and forkserver (a dead forkserver says nothing about
  main), and pid reuse cannot fool it.
* So the control name stays for the pool's whole life (slot names still go as
  soon as every worker has mapped them), and a child that os.fork() makes in
  main closes its inherited copy of the lock's descriptor at once (the at-fork
  hook in poolloader.shm.fork; exec closes it too): a long-lived child must not
  keep a dead main's pool "alive".
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

Main's segments are mapped with MADV_DONTFORK (poolloader.shm.fork), so a child
forked later (any loader's workers) does not inherit them, but it does inherit the
Python objects that point at them; every teardown path here and in the iterator
does nothing in a process other than the one that made the pool.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets

import posix_ipc

from poolloader.errors import ShmSpaceError
from poolloader.shm import fork
from poolloader.shm._shm import Mapping

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


def take_owner_lock(fd: int) -> bool:
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


def owner_lock_held(fd: int) -> bool:
    """Whether another open file description holds a lock on `fd`'s file."""
    return _ofd_lock(fd, fcntl.F_OFD_GETLK).l_type != fcntl.F_UNLCK




class _NameLost(Exception):
    """A sweeper took a new control segment's name before its owner could lock it."""


def pool_names(prefix: str) -> list[str]:
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
        if not take_owner_lock(shm.fd):
            return []  # its owner lives (or another sweeper is at it)
        removed = []
        for name in pool_names(prefix):  # listed again under the lock: all of them
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
        raise space_error(nbytes, free, what)
    with fork.creating():  # no fork between the descriptor's creation and its record
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
        fork.hold(shm.fd)
    keep_fd = False
    try:
        # A sweeper may have opened the name before we locked it: then it holds the
        # lock (we fail to take it) or has already unlinked the name.
        if claim and not (take_owner_lock(shm.fd) and _same_file(SHM_DIR + name, shm.fd)):
            raise _NameLost(name)
        try:
            os.posix_fallocate(shm.fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise space_error(nbytes, shm_free_bytes(), what) from None
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
            fork.release(shm.fd)  # os.close of it: posix_ipc keeps no other copy


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


def space_error(nbytes: int, free: int, what: str) -> ShmSpaceError:
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


def claim_control(owner_pid: int, nbytes: int, limit: int | None) -> tuple[str, Mapping, int]:
    """A new pool's control segment under a fresh prefix, with its owner lock held:
    (prefix, mapping, locked descriptor). Retries under a new token if a sweeper takes
    the name before the lock (module docstring)."""
    for _ in range(_CLAIM_TRIES):
        prefix = f"/{NAME_TAG}-{owner_pid}-{secrets.token_hex(8)}"
        try:
            mapping, fd = _create(control_name(prefix), nbytes, "the control block", 0, limit,
                                  dontfork=True, claim=True)
        except _NameLost:
            continue
        assert fd is not None  # held since its creation (_create)
        return prefix, mapping, fd
    raise RuntimeError(f"internal error: {_CLAIM_TRIES} new control segments in a row were "
                       "unlinked by other processes before this one could lock them")


def release_owner_lock(fd: int) -> None:
    """Close a pool's locked descriptor: its owner lock goes with it."""
    fork.release(fd)


# -- the backend objects SlotPool and WorkerSlots use ---------------------------------

class PosixSegments:
    """Main side of the POSIX backend: named segments in /dev/shm (module docstring).

    The pool's names are the prefix's; a slot segment's name is released (unlinked)
    once every worker has mapped it, the control name (owner lock) at close()."""

    kind = "posix"

    def __init__(self, owner_pid: int):
        self.owner_pid = owner_pid
        self.prefix = ""  # set by claim_control
        self._control_name = ""
        self._lock_fd: int | None = None
        self._names: set[str] = set()  # every name not yet unlinked

    def check_space(self, nbytes: int, what: str) -> None:
        free = shm_free_bytes()
        if nbytes > free:
            raise space_error(nbytes, free, what)

    def claim_control(self, nbytes: int) -> Mapping:
        sweep_stale()
        self.prefix, mapping, self._lock_fd = claim_control(self.owner_pid, nbytes, None)
        self._control_name = control_name(self.prefix)
        self._names.add(self._control_name)
        return mapping

    @property
    def locator(self) -> tuple:
        """What a worker needs to attach (picklable)."""
        return (self.kind, self.prefix)

    def create(self, slot: int, generation: int, nbytes: int, what: str):
        """(mapping, handle a, handle b, release key) of a new slot segment."""
        name = slot_name(self.prefix, slot, generation)
        mapping = create_segment(name, nbytes, what, 0, None)
        self._names.add(name)
        return mapping, 0, 0, name

    def release(self, name: str) -> None:
        """Every worker has mapped it, or nobody needs it any more: unlink the name."""
        if name in self._names:
            self._names.discard(name)
            unlink_quietly(name)

    @property
    def live_handles(self) -> set[str]:
        return set(self._names)

    def close(self) -> None:
        # slot names first, the control name last: a sweeper that finds slot names
        # without their control segment leaves them alone
        for name in sorted(self._names, key=lambda name: name == self._control_name):
            unlink_quietly(name)
        self._names.clear()
        if self._lock_fd is not None:
            release_owner_lock(self._lock_fd)  # the names are gone already
            self._lock_fd = None


class PosixAttachment:
    """Worker side of the POSIX backend: the control segment mapped by name, and the
    descriptor that answers whether main's owner lock is still held."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        shm = posix_ipc.SharedMemory(control_name(prefix))
        try:
            self.control_mapping = Mapping(shm.fd, shm.size)
        except BaseException:
            shm.close_fd()
            raise
        self._lock_fd = shm.fd  # this worker's own descriptor of the control segment

    def owner_alive(self) -> bool:
        return owner_lock_held(self._lock_fd)

    def open_slot(self, slot: int, generation: int, size: int, a: int, b: int) -> Mapping | None:
        """Map that generation of a slot; None if main replaced it meanwhile."""
        try:
            return open_segment(slot_name(self.prefix, slot, generation))
        except posix_ipc.ExistentialError:
            return None

    def orphaned(self) -> None:
        """Main died: remove every name it owned, control block last. Found by listing
        /dev/shm for the prefix, not from the slot table, which any process of the pool
        could have overwritten."""
        for name in pool_names(self.prefix):
            unlink_quietly(name)
