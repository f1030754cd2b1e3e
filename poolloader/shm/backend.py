"""The shared-memory backend interface, and everything the backends share.

A backend is one module in poolloader.shm.backends (memfd, posix) that says where a
pool's segments live and how a worker finds them; SlotPool (pool.py) and WorkerSlots
use it only through the two protocols below, so a third backend (a node-wide pool)
is one new module there. Each backend module exposes the names `Backend` lists:
KIND (its module name, what `shm_backend=` says), DESCRIPTION (for the fallback
warning), supported() and refuses(max_slots), and the two sides, Segments (main's,
made with the owner's pid) and Attachment (a worker's, made from the rest of the
locator Segments.locator hands out, whose first element is KIND). Both sides hand out
the same poolloader.shm._shm.Mapping, so nothing above pool.py (the codec, the CUDA
registration) knows which backend is in use.

Written once here: the owner lock, retire(), page rounding, the cap (shm_limit= or
$POOLLOADER_SHM_LIMIT), the space check and its error (Space: each backend says what
its memory is, how much there is, where that figure comes from and how to get more),
and the reservation that turns a lack of memory into that error instead of a SIGBUS.

The owner lock. /dev/shm is shared by every process on the host and often by several
containers (docker --ipc=host, a pod's memory volume), each with its own PID
namespace, so a pid cannot say whether a pool's owner lives: it may belong to another
namespace, or have been reused. The owner's liveness is an open file description lock
instead: main takes a write lock over its control segment (fcntl F_OFD_SETLK) when it
creates it and holds it, on the one descriptor it keeps per pool, until close(). The
kernel drops it when that descriptor closes, however the process ends (SIGKILL
included), and every process that shares the segment sees it, whatever its PID
namespace, because it lives on the inode.

* The workers' parent-death check (`owner_alive`) asks the kernel whether the lock
  is still held (F_OFD_GETLK) on the worker's own descriptor of the same inode:
  exact under fork, spawn and forkserver (a dead forkserver says nothing about
  main), and pid reuse cannot fool it.
* A child that os.fork() makes in main closes its inherited copy of the lock's
  descriptor at once (the at-fork hook in poolloader.shm.fork; exec closes it too): a
  long-lived child must not keep a dead main's pool "alive".

Main's segments are mapped with MADV_DONTFORK (poolloader.shm.fork), so a child
forked later (any loader's workers) does not inherit them, but it does inherit the
Python objects that point at them; every teardown path in the backends, the pool and
the iterator does nothing in a process other than the one that made the pool.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from poolloader.errors import ShmSpaceError
from poolloader.shm import fork
from poolloader.shm._shm import Mapping

PAGE = os.sysconf("SC_PAGE_SIZE")
SHM_LIMIT_ENV = "POOLLOADER_SHM_LIMIT"
LOWER_USE = "lower slot_bytes, prefetch_factor or num_workers"


def page_round(nbytes: int) -> int:
    return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)


def retire(mapping) -> None:
    """Unmap now if nothing views the mapping; otherwise its last view unmaps it."""
    try:
        mapping.close()
    except BufferError:
        pass


# -- the interface ---------------------------------------------------------------------

class MainSide(Protocol):
    """A backend's Segments: main's side of one pool. Only the process that made it
    calls it. A release key is whatever lets workers find a segment (a descriptor, a
    name); released once every worker has mapped the segment, or when nobody needs it."""

    kind: str
    # slot pages are charged as they are written, not reserved at creation: a worker
    # may give back those past its reply (poolloader.wire.slot_format.return_tail)
    charged_as_written: bool

    def check_space(self, nbytes: int, what: str) -> None:
        """Raise ShmSpaceError (Space.check) if `nbytes` more cannot be had now."""

    def claim_control(self, nbytes: int) -> Mapping:
        """Create the pool's control segment and take its owner lock; once per pool."""

    @property
    def locator(self) -> tuple:
        """What a worker needs to attach (picklable): (KIND, *Attachment's arguments)."""

    def create(self, slot: int, generation: int, nbytes: int, what: str,
               written: int | None = None) -> tuple[Mapping, int, int, Hashable]:
        """A new slot segment, space-checked and reserved: (mapping, handle a, handle b,
        release key); the two handles go into the slot table for Attachment.open_slot.
        `written`: the bytes its first writer will write, where known; a backend that
        charges pages as written checks for those, one that reserves at creation for
        all `nbytes`."""

    def release(self, key) -> None:
        """Workers no longer need to find that segment (idempotent)."""

    @property
    def live_handles(self) -> set:
        """Release keys not yet released (the control segment's included or not, as the
        backend keeps it)."""

    def close(self) -> None:
        """Release everything, the owner lock last. The mappings are the caller's."""


class WorkerSide(Protocol):
    """A backend's Attachment: a worker's side of one pool."""

    control_mapping: Mapping

    def owner_alive(self) -> bool:
        """Whether main's owner lock is still held (one fcntl)."""

    def open_slot(self, slot: int, generation: int, size: int, a: int, b: int) -> Mapping | None:
        """Map that generation of a slot (a, b: its slot-table handles); None if main
        replaced it meanwhile (a later sync maps the newer one)."""

    def orphaned(self) -> None:
        """Main died: remove whatever it left that outlives processes."""

    def close(self) -> None:
        """Close this attachment's own descriptor (a node pool's process leaves a rank's
        pool while it goes on living). The mappings are the caller's."""


class Backend(Protocol):
    """What each module in poolloader.shm.backends exposes (module docstring)."""

    KIND: str
    DESCRIPTION: str  # what the fallback warning says a pool uses instead
    Segments: Callable[[int], MainSide]  # (owner pid)
    Attachment: Callable[..., WorkerSide]  # (*locator[1:])

    def supported(self) -> str | None:
        """None if this process can use the backend; else why not."""

    def refuses(self, max_slots: int) -> str | None:
        """None if a pool of up to `max_slots` slots can use the backend here; else why
        not (supported()'s answer, or what this pool's size would exceed)."""


# -- how much there is -----------------------------------------------------------------

@dataclass(frozen=True)
class Space:
    """A backend's memory, for the space check and its one error text."""

    medium: str  # what the bytes are: "memory", "/dev/shm"
    fix: str  # how to have more, first thing said after the figures
    measure: Callable[[], tuple[int, str]]  # (bytes available now, where that figure comes from)
    note: str = ""  # said last, in parentheses

    def check(self, nbytes: int, what: str) -> None:
        free, where = self.measure()
        if nbytes > free:
            raise self._error(nbytes, what, free, where)

    def error(self, nbytes: int, what: str) -> ShmSpaceError:
        """The error for `nbytes` that could not be had, with the figure measured now."""
        return self._error(nbytes, what, *self.measure())

    def _error(self, nbytes: int, what: str, free: int, where: str) -> ShmSpaceError:
        return ShmSpaceError(
            f"poolloader needs {nbytes} bytes of {self.medium} for {what}, but only {free} bytes "
            f"are available ({where}). {self.fix}, or {LOWER_USE}."
            + (f" ({self.note})" if self.note else ""))

    def reserve(self, fd: int, nbytes: int, what: str) -> None:
        """Reserve a new segment's pages now (posix_fallocate), so memory that is not
        there is this error, not a SIGBUS of its first writer or an OOM kill mid-epoch.
        Where the file system cannot reserve, the segment stays unreserved."""
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise self.error(nbytes, what) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise


def cap(shm_limit: int | None) -> int | None:
    """The pool's cap in bytes: shm_limit= if given, else $POOLLOADER_SHM_LIMIT, else none."""
    if shm_limit is None and os.environ.get(SHM_LIMIT_ENV):
        return int(os.environ[SHM_LIMIT_ENV])
    return shm_limit


def check_cap(limit: int | None, nbytes: int, pool_bytes: int, what: str) -> None:
    """ShmSpaceError if `nbytes` more would bring a pool of `pool_bytes` over `limit`."""
    if limit is not None and pool_bytes + nbytes > limit:
        raise ShmSpaceError(
            f"poolloader needs {nbytes} more bytes of shared memory for {what}, which "
            f"would bring the pool to {pool_bytes + nbytes} bytes, over the cap of {limit} "
            f"bytes (shm_limit= or ${SHM_LIMIT_ENV}). Raise the cap, or {LOWER_USE}.")


# -- the owner lock (module docstring) ---------------------------------------------------

class _Flock(ctypes.Structure):
    """struct flock as Linux's F_OFD_* commands read it (64-bit offsets)."""
    _fields_ = [("l_type", ctypes.c_short), ("l_whence", ctypes.c_short),
                ("l_start", ctypes.c_int64), ("l_len", ctypes.c_int64), ("l_pid", ctypes.c_int)]


def _ofd_lock(fd: int, command: int, start: int = 0, length: int = 0) -> _Flock:
    """A write lock over `length` bytes from `start` (0: to the end of the file, so the
    whole file by default): set it (F_OFD_SETLK) or test for one (F_OFD_GETLK)."""
    request = _Flock(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    return _Flock.from_buffer_copy(fcntl.fcntl(fd, command, bytes(request)))


def take_owner_lock(fd: int, byte: int | None = None) -> bool:
    """Take the owner lock on `fd`'s open file description; False if someone holds it.
    `byte`: lock that one byte of the file only (several owners of one segment, each
    its own byte: poolloader.shm.node), else the whole file."""
    try:
        if byte is None:
            _ofd_lock(fd, fcntl.F_OFD_SETLK)
        else:
            _ofd_lock(fd, fcntl.F_OFD_SETLK, byte, 1)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if e.errno == errno.EINVAL:
            raise OSError(e.errno, "poolloader needs open file description locks (fcntl "
                          "F_OFD_SETLK, Linux 3.15 or later) on its shared memory") from None
        raise
    return True


def unlock_byte(fd: int, byte: int) -> None:
    """Drop the lock take_owner_lock(fd, byte) took, now: closing `fd` alone does not
    while another descriptor of the same open file description lives (Python's mmap
    keeps a dup of the one it maps)."""
    request = _Flock(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, bytes(request))


def owner_lock_held(fd: int, byte: int | None = None) -> bool:
    """Whether another open file description holds a lock on `fd`'s file (`byte`: on
    that byte of it)."""
    if byte is None:
        return _ofd_lock(fd, fcntl.F_OFD_GETLK).l_type != fcntl.F_UNLCK
    return _ofd_lock(fd, fcntl.F_OFD_GETLK, byte, 1).l_type != fcntl.F_UNLCK


def release_owner_lock(fd: int) -> None:
    """Close a pool's locked descriptor (registered with fork.hold): its owner lock goes
    with it."""
    fork.release(fd)
