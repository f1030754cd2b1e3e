"""Anonymous shared memory: segments made with memfd_create, with no name anywhere.

The default backend (SlotPool's `backend="memfd"`). A memfd segment lives in the
kernel's shmem like a /dev/shm file but outside that tmpfs, so Docker's 64 MiB
/dev/shm does not bound it; it is charged to the memory cgroup of the process that
touches its pages, as any memory is, and it has no name: when the last process
holding it (a descriptor or a mapping) dies, the kernel frees it. A crash of every
process leaves nothing behind and no sweep is needed.

How a worker finds a segment: main keeps each new segment's descriptor open until
every worker has mapped it (the ack table, as for the POSIX backend's names), and a
worker opens it as /proc/<main pid>/fd/<n>. That is an ordinary open of the same
inode, needing the same uid and PTRACE_MODE_READ, which Yama's ptrace_scope does not
restrict (it restricts attaching only); it needs /proc mounted, as every container
runtime does. The slot table carries the descriptor number and the inode; a worker
checks the inode after opening, because main may have closed that number and reused
it for a newer segment meanwhile (then it retries at its next sync), and because a
dead main's pid can be reused. Weighed and not taken: SCM_RIGHTS needs a socket per
worker that spawn and forkserver children must be handed, and a send per segment
per worker that main must not block on; pidfd_getfd (Linux 5.6) needs
PTRACE_MODE_ATTACH, which Yama's default scope 1 refuses to a worker reaching its
parent. Main's descriptors: one per pool (the control segment, which carries the
owner lock), plus one per segment not yet mapped by every worker (none in steady
state; at most max_slots).

Sizes are sealed (F_SEAL_SHRINK | F_SEAL_GROW): no process can truncate a segment
under another's mapping (which would SIGBUS it). Pages are reserved at creation
(posix_fallocate), so memory that is not there is a clear error now, not a SIGBUS
or an OOM kill mid-epoch; before that, the request is checked against what the
memory cgroup allows (memory.max − memory.current, or v1's limit − usage) and the
machine's MemAvailable, whichever is smaller.
"""
from __future__ import annotations

import fcntl
import os
import resource

from poolloader.shm import fork
from poolloader.shm._shm import Mapping
from poolloader.shm.backend import Space, owner_lock_held, release_owner_lock, take_owner_lock

KIND = "memfd"
DESCRIPTION = "anonymous segments (memfd_create)"
FD_MARGIN = 16  # descriptors left to the user and to torch when this backend is chosen
NAME = "poolloader"  # what /proc/<pid>/maps shows: /memfd:poolloader-<what> (deleted)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SEAL") else 0
CGROUP_ROOT = "/sys/fs/cgroup"


# -- how much memory there is ----------------------------------------------------------

def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_dirs() -> list[tuple[str, str, str]]:
    """(directory, limit file, usage file) of every memory cgroup level above this
    process that is visible here, innermost first (v2 unified, or v1 memory)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            mount, limit, usage = CGROUP_ROOT, "memory.max", "memory.current"
            if not os.path.exists(os.path.join(mount, "cgroup.controllers")):
                mount = os.path.join(CGROUP_ROOT, "unified")
        elif "memory" in controllers.split(","):
            mount, limit, usage = os.path.join(CGROUP_ROOT, "memory"), "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        else:
            continue
        # Inside a cgroup namespace the path is relative to the mount's root; outside
        # one, a path the mount does not show falls back to the mount's root.
        parts = [p for p in path.split("/") if p]
        while True:
            directory = os.path.join(mount, *parts)
            if os.path.isdir(directory):
                found.append((directory, limit, usage))
            if not parts:
                break
            parts.pop()
    return found


def memory_available() -> tuple[int, str]:
    """(bytes a new segment may use, what bounds it): the tightest memory cgroup's
    limit − usage where a limit is set, else /proc/meminfo's MemAvailable."""
    best, where = None, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best, where = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                    break
    except OSError:
        pass
    for directory, limit_file, usage_file in _cgroup_dirs():
        limit = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file))
        if limit is None or usage is None or limit >= 1 << 62:
            continue  # no limit at this level
        free = max(0, limit - usage)
        if best is None or free < best:
            best, where = free, (f"the memory cgroup's {limit_file} ({limit}) minus "
                                 f"{usage_file} ({usage}) in {directory}")
    if best is None:
        best, where = 1 << 62, "no limit found"
    return best, where


SPACE = Space("memory", "Raise the container's memory limit (Docker: --memory; Kubernetes: "
              "resources.limits.memory)", lambda: memory_available(),  # looked up per call
              "This memory is not /dev/shm: --shm-size does not change it.")


# -- main side ---------------------------------------------------------------------------

_supported: dict[int, str | None] = {}  # pid -> supported()'s answer


def supported() -> str | None:
    """None if this process can make memfd segments that its workers can open;
    else why not (the pool then needs backend="posix"). Asked once per process."""
    pid = os.getpid()
    if pid not in _supported:
        _supported[pid] = _probe()
    return _supported[pid]


def _probe() -> str | None:
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available (Linux 3.17+, Python 3.8+)"
    try:
        fd = os.memfd_create(f"{NAME}-probe", os.MFD_CLOEXEC)
    except OSError as e:
        return f"memfd_create failed: {e}"
    try:
        probe = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"workers could not open main's segments through /proc/<pid>/fd ({e})"
    finally:
        os.close(fd)
    os.close(probe)
    return None


def create(nbytes: int, what: str, label: str, dontfork: bool = True) -> tuple[Mapping, int, int]:
    """A new sealed, reserved segment of `nbytes`: (mapping, descriptor, inode).

    The caller keeps the descriptor (registered with fork.hold) until every
    worker has opened it, then closes it with fork.release."""
    fd = os.memfd_create(f"{NAME}-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        SPACE.reserve(fd, nbytes, what)
        if _SEALS:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = Mapping(fd, nbytes, dontfork)
        inode = os.fstat(fd).st_ino
    except BaseException:
        os.close(fd)
        raise
    fork.hold(fd)
    return mapping, fd, inode


def _descriptor_headroom() -> int:
    """Descriptors this process may still open (RLIMIT_NOFILE's soft limit less those open)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    try:
        used = len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        return soft
    return soft - used


def refuses(max_slots: int) -> str | None:
    """supported()'s answer, or, where RLIMIT_NOFILE leaves fewer than `max_slots` +
    FD_MARGIN descriptors, that: a pool can need one descriptor per slot for a moment (a
    new segment's, until every worker has mapped it: all of them when the pool is made)."""
    why_not = supported()
    if why_not is None:
        headroom = _descriptor_headroom()
        if headroom < max_slots + FD_MARGIN:
            why_not = (f"a pool of {max_slots} slots may hold {max_slots + 1} descriptors while "
                       f"its workers attach, and RLIMIT_NOFILE leaves {headroom} (raise ulimit -n)")
    return why_not


# -- worker side -------------------------------------------------------------------------

class StaleHandle(Exception):
    """The descriptor main published is gone or now names another segment: main
    replaced that segment meanwhile; a later sync finds the newer one."""


def open_segment(main_pid: int, fd: int, inode: int, size: int, keep_fd: bool = False):
    """Map main's segment (descriptor `fd`, `inode`, `size` bytes) from a worker.

    Raises StaleHandle if that descriptor is closed or is another inode now, and
    PermissionError with what to do if /proc refuses. Returns the Mapping, or with
    `keep_fd` (mapping, the worker's own descriptor of it)."""
    path = f"/proc/{main_pid}/fd/{fd}"
    try:
        own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        raise StaleHandle(path) from None
    except PermissionError as e:
        raise PermissionError(
            e.errno, f"a PoolLoader worker cannot open main's shared memory through {path}: "
            f"{e.strerror}. Use PoolLoader(shm_backend='posix') (or "
            "POOLLOADER_SHM_BACKEND=posix) where /proc/<pid>/fd is not accessible") from None
    try:
        st = os.fstat(own)
        if st.st_ino != inode or st.st_size != size:
            raise StaleHandle(path)
        mapping = Mapping(own, size)
    except BaseException:
        os.close(own)
        raise
    if keep_fd:
        return mapping, own
    os.close(own)
    return mapping


class Segments:
    """Main side of the memfd backend (module docstring). A segment's descriptor is
    its release key: kept until every worker has mapped it, closed then."""

    kind = KIND

    def __init__(self, owner_pid: int):
        self.owner_pid = owner_pid
        self._control: tuple[int, int, int] | None = None  # (fd, inode, size)
        self._fds: set[int] = set()  # slot segments' descriptors not yet released

    def check_space(self, nbytes: int, what: str) -> None:
        SPACE.check(nbytes, what)

    def claim_control(self, nbytes: int) -> Mapping:
        """The control segment's descriptor is the pool's one descriptor for its whole
        life: it carries the owner lock (poolloader.shm.backend)."""
        mapping, fd, inode = create(nbytes, "the control block", "control")
        if not take_owner_lock(fd):
            release_owner_lock(fd)
            raise RuntimeError("internal error: a new memfd's owner lock is already held")
        self._control = (fd, inode, nbytes)
        return mapping

    @property
    def locator(self) -> tuple:
        """What a worker needs to attach (picklable): main's pid and the control
        segment's descriptor, inode and size."""
        assert self._control is not None
        return (self.kind, self.owner_pid) + self._control

    def create(self, slot: int, generation: int, nbytes: int, what: str):
        """(mapping, descriptor, inode, release key) of a new slot segment. Checked
        against the memory available first: under a cgroup limit, reserving pages that
        are not there may wake the OOM killer instead of failing."""
        SPACE.check(nbytes, what)
        mapping, fd, inode = create(nbytes, what, f"slot{slot}")
        self._fds.add(fd)
        return mapping, fd, inode, fd

    def release(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.discard(fd)
            fork.release(fd)

    @property
    def live_handles(self) -> set[int]:
        """Descriptors main still holds for workers to open (the control one aside)."""
        return set(self._fds)

    def close(self) -> None:
        for fd in self._fds:
            fork.release(fd)
        self._fds.clear()
        if self._control is not None:
            release_owner_lock(self._control[0])
            self._control = None


class Attachment:
    """Worker side: the control segment opened through main's /proc/<pid>/fd, and this
    worker's own descriptor of it, which answers whether main's owner lock is held."""

    def __init__(self, main_pid: int, fd: int, inode: int, size: int):
        self.main_pid = main_pid
        try:
            self.control_mapping, self._fd = open_segment(main_pid, fd, inode, size, keep_fd=True)
        except StaleHandle:
            # main closed its control segment: it closed the pool, or died
            raise RuntimeError(f"PoolLoader worker: the pool's control segment (descriptor {fd} "
                               f"of pid {main_pid}) is gone: the main process closed the pool "
                               "or exited before this worker started") from None

    def owner_alive(self) -> bool:
        return owner_lock_held(self._fd)

    def open_slot(self, slot: int, generation: int, size: int, fd: int, inode: int) -> Mapping | None:
        """Map a slot's segment; None if main replaced it meanwhile."""
        try:
            return open_segment(self.main_pid, fd, inode, size)
        except StaleHandle:
            return None

    def orphaned(self) -> None:
        """Main died: nothing to remove, the segments have no names; the kernel frees
        them when the last process that maps one exits."""
