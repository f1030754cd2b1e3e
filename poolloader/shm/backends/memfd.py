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
runtime does, and a main process that is dumpable (or workers with CAP_SYS_PTRACE),
which an LSM may also forbid. So the backend is judged, once per process, by what a
worker does: a forked child opens one of main's memfds through /proc (supported());
where that fails the pool falls back to the POSIX backend with one warning. The
slot table carries the descriptor number and the inode; a worker checks the inode
after opening, because main may have closed that number and reused it for a newer
segment meanwhile (then it retries at its next sync), and because a dead main's pid
can be reused. Weighed and not taken: SCM_RIGHTS needs a socket per
worker that spawn and forkserver children must be handed, and a send per segment
per worker that main must not block on; pidfd_getfd (Linux 5.6) needs
PTRACE_MODE_ATTACH, which Yama's default scope 1 refuses to a worker reaching its
parent. Main's descriptors: one per pool (the control segment, which carries the
owner lock), plus one per segment not yet mapped by every worker (none in steady
state; at most max_slots).

Sizes are sealed (F_SEAL_SHRINK | F_SEAL_GROW): no process can truncate a segment
under another's mapping (which would SIGBUS it). A slot's pages are not reserved at
creation: a memfd is charged to the memory cgroup page by page as it is written, as
anonymous memory is, so a slot costs what its batches wrote, never its headroom
(growth's 1.25×) or a spare slot no batch has used (issue 45: reserving every slot
made a PoolLoader's container charge 1.35× DataLoader's). A memfd lives on the
kernel's internal shmem mount, which has no size limit: an unreserved page cannot
SIGBUS its writer as a full tmpfs would (the POSIX backend still reserves), and a
charge past the cgroup's limit is the same OOM kill a DataLoader batch of that size
would meet. Before a segment is made, its size is checked against what the memory
cgroup allows and the machine's MemAvailable, whichever is smaller, so a pool that
cannot fit is a clear error at creation. The control block is reserved (small).

What a memory cgroup allows is its limit less its working set, as the kubelet counts
it: usage less the clean page cache that reclaim frees when a charge meets the limit
(memory.max − memory.current + inactive_file + active_file in v2's memory.stat;
v1: memory.limit_in_bytes − memory.usage_in_bytes + total_inactive_file +
total_active_file). A job that has read its data has a cgroup full of cache, and
that cache gives way to a segment as it gives way to DataLoader's workers. Dirty
pages and pages under writeback are not counted (reclaim cannot free them without
waiting on the disk), nor is shmem — tmpfs, /dev/shm and memfd segments, this
pool's own among them — which the kernel keeps on the anonymous lists, never on the
file ones: with no swap, charging more than the limit less all of that would wake
the OOM killer, so such a request is refused here.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import resource
import select
import signal
import warnings

from poolloader.errors import PoolGone
from poolloader.shm import fork
from poolloader.shm._shm import Mapping
from poolloader.shm.backend import (
    Space,
    owner_lock_held,
    page_round,
    release_owner_lock,
    take_owner_lock,
)

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


# memory.stat keys, per cgroup version: (clean file cache that reclaim frees, the part
# of it that is dirty or under writeback). v1's "total_" keys count the whole subtree,
# as its usage does; v2's memory.stat is hierarchical already.
_STAT_KEYS = {
    "v2": (("inactive_file", "active_file"), ("file_dirty", "file_writeback")),
    "v1": (("total_inactive_file", "total_active_file"), ("total_dirty", "total_writeback")),
}


def cgroup_levels(controller: str) -> list[tuple[str, str]]:
    """(directory, "v1" or "v2") of every cgroup level above this process that
    `controller` ("memory", "cpu") is visible at here, innermost first: the v2 unified
    hierarchy, or the v1 hierarchy whose controllers include it."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            mount, version = CGROUP_ROOT, "v2"
            if not os.path.exists(os.path.join(mount, "cgroup.controllers")):
                mount = os.path.join(CGROUP_ROOT, "unified")
        elif controller in controllers.split(","):
            mount, version = os.path.join(CGROUP_ROOT, controllers), "v1"
        else:
            continue
        # Inside a cgroup namespace the path is relative to the mount's root; outside
        # one, a path the mount does not show falls back to the mount's root.
        parts = [p for p in path.split("/") if p]
        while True:
            directory = os.path.join(mount, *parts)
            if os.path.isdir(directory):
                found.append((directory, version))
            if not parts:
                break
            parts.pop()
    return found


def _cgroup_dirs() -> list[tuple[str, str, str, str]]:
    """(directory, limit file, usage file, "v1" or "v2") of every memory cgroup level
    above this process that is visible here, innermost first (v2 unified, or v1 memory)."""
    files = {"v2": ("memory.max", "memory.current"),
             "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
    return [(directory, *files[version], version)
            for directory, version in cgroup_levels("memory")]


def _read_stat(directory: str) -> dict[str, int]:
    """A cgroup's memory.stat as {key: value}; empty where it cannot be read."""
    stat: dict[str, int] = {}
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                try:
                    stat[key] = int(value)
                except ValueError:
                    pass
    except OSError:
        pass
    return stat


def reclaimable(directory: str, version: str) -> tuple[int, str]:
    """(bytes of clean page cache reclaim frees in this cgroup, how that was counted):
    inactive + active file pages less those dirty or under writeback (module docstring)."""
    (cache_keys, dirty_keys) = _STAT_KEYS[version]
    stat = _read_stat(directory)
    cache = sum(stat.get(k, 0) for k in cache_keys)
    dirty = sum(stat.get(k, 0) for k in dirty_keys)
    return max(0, cache - dirty), (f"{' + '.join(cache_keys)} ({cache}) less "
                                   f"{' + '.join(dirty_keys)} ({dirty}) in memory.stat")


def memory_available() -> tuple[int, str]:
    """(bytes a new segment may use, what bounds it): the tightest memory cgroup's
    limit less its working set (usage less reclaimable page cache) where a limit is
    set, else /proc/meminfo's MemAvailable."""
    best, where = None, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best, where = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                    break
    except OSError:
        pass
    for directory, limit_file, usage_file, version in _cgroup_dirs():
        limit = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file))
        if limit is None or usage is None or limit >= 1 << 62:
            continue  # no limit at this level
        cache, counted = reclaimable(directory, version)
        free = max(0, limit - (usage - min(cache, usage)))
        if best is None or free < best:
            best, where = free, (f"the memory cgroup's {limit_file} ({limit}) minus "
                                 f"{usage_file} ({usage}) plus its reclaimable page cache, "
                                 f"{counted}, in {directory}")
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
    """What workers do, tried once: a child process opens one of this process's memfds
    through /proc/<pid>/fd. Opening it from here proves nothing: a process may always
    open its own descriptors, while another needs PTRACE_MODE_READ over it, which a
    non-dumpable main (prctl PR_SET_DUMPABLE 0, a credential change), an LSM or a
    container without CAP_SYS_PTRACE in front of such a main refuses."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available (Linux 3.17+, Python 3.8+)"
    try:
        fd = os.memfd_create(f"{NAME}-probe", os.MFD_CLOEXEC)
    except OSError as e:
        return f"memfd_create failed: {e}"
    try:
        return _child_opens(f"/proc/{os.getpid()}/fd/{fd}")
    finally:
        os.close(fd)


PROBE_TIMEOUT_S = 10.0


def _child_opens(path: str) -> str | None:
    """None if a forked child of this process can open `path` read-write, as a worker
    opens main's segments; else why not. The child does nothing else: one open, one
    write of its errno to a pipe, _exit. A forked child has exactly main's credentials
    and capabilities (a spawned worker's exec gives root no more than its bounding set,
    and main itself was started the same way). The answer travels through the pipe, not
    the exit status, which a SIGCHLD set to SIG_IGN would take away."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns of fork() in a threaded process: the child runs no
            # Python code beyond the at-fork hooks, one open and _exit
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child
            code = 255
            try:
                try:
                    os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
                    code = 0
                except OSError as e:
                    code = e.errno if e.errno and e.errno < 255 else 255
                os.write(w, bytes([code]))
            finally:
                os._exit(0)
        os.close(w)
        w = -1
        poller = select.poll()  # not select(): a descriptor above 1024 is fine
        poller.register(r, select.POLLIN)
        answer = os.read(r, 1) if poller.poll(int(PROBE_TIMEOUT_S * 1000)) else b""
        if not answer:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # reaped already (SIGCHLD ignored)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    if answer == b"\0":
        return None
    if not answer:
        return (f"a child process given {PROBE_TIMEOUT_S:.0f} s to open main's segments "
                f"through {path}, as workers do, did not answer")
    code = answer[0]
    why = os.strerror(code) if code != 255 else "an error"
    return (f"a child process cannot open main's segments through /proc/<main pid>/fd as "
            f"workers do ({why}: a main process that is not dumpable, after prctl "
            "PR_SET_DUMPABLE 0 or a change of credentials, where children lack "
            "CAP_SYS_PTRACE; or an LSM's policy)")


def create(nbytes: int, what: str, label: str, dontfork: bool = True,
           reserve: bool = False) -> tuple[Mapping, int, int]:
    """A new sealed segment of `nbytes`: (mapping, descriptor, inode); its pages
    reserved now with `reserve`, else charged as they are written (module docstring).

    The caller keeps the descriptor (registered with fork.hold) until every
    worker has opened it, then closes it with fork.release."""
    with fork.creating():  # no fork between the descriptor's creation and its record
        fd = os.memfd_create(f"{NAME}-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        fork.hold(fd)
    try:
        os.ftruncate(fd, nbytes)
        if reserve:
            SPACE.reserve(fd, nbytes, what)
        if _SEALS:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = Mapping(fd, nbytes, dontfork)
        inode = os.fstat(fd).st_ino
    except BaseException:
        fork.release(fd)
        raise
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


def _open_checked(main_pid: int, fd: int, inode: int, size: int) -> int:
    """A worker's own descriptor of main's segment (descriptor `fd`, `inode`, `size`
    bytes), opened through /proc and checked to be that segment (module docstring)."""
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
    except BaseException:
        os.close(own)
        raise
    return own


def open_segment(main_pid: int, fd: int, inode: int, size: int, keep_fd: bool = False):
    """Map main's segment (descriptor `fd`, `inode`, `size` bytes) from a worker.

    Raises StaleHandle if that descriptor is closed or is another inode now, and
    PermissionError with what to do if /proc refuses. Returns the Mapping, or with
    `keep_fd` (mapping, the worker's own descriptor of it)."""
    own = _open_checked(main_pid, fd, inode, size)
    try:
        mapping = Mapping(own, size)
    except BaseException:
        os.close(own)
        raise
    if keep_fd:
        return mapping, own
    os.close(own)
    return mapping


def open_private(main_pid: int, fd: int, inode: int, size: int, keep_fd: bool = False):
    """Map main's segment copy-on-write (MAP_PRIVATE, readable and writable) from a
    worker: its pages stay the segment's, shared with every process that maps it, until
    this process writes one, which then becomes this process's own copy; nobody else
    sees that write, and nothing this process does changes the segment. The mapping
    keeps the segment alive until the returned mmap is unmapped: when it and every
    buffer exported from it are gone. The descriptor opened for it is closed here, or
    with `keep_fd` returned too, (mapping, descriptor), for map_private to make more
    mappings of the segment. Raises as open_segment."""
    own = _open_checked(main_pid, fd, inode, size)
    try:
        mapping = map_private(own, size)
    except BaseException:
        os.close(own)
        raise
    if keep_fd:
        return mapping, own
    os.close(own)
    return mapping


def map_private(fd: int, size: int) -> mmap.mmap:
    """Another copy-on-write mapping (open_private's kind) of a segment this process
    holds descriptor `fd` of: a write into one mapping shows in no other."""
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class Segments:
    """Main side of the memfd backend (module docstring). A segment's descriptor is
    its release key: kept until every worker has mapped it, closed then."""

    kind = KIND
    charged_as_written = True  # MainSide

    def __init__(self, owner_pid: int):
        self.owner_pid = owner_pid
        self._control: tuple[int, int, int] | None = None  # (fd, inode, size)
        self._fds: set[int] = set()  # slot segments' descriptors not yet released

    def check_space(self, nbytes: int, what: str) -> None:
        SPACE.check(nbytes, what)

    def claim_control(self, nbytes: int) -> Mapping:
        """The control segment's descriptor is the pool's one descriptor for its whole
        life: it carries the owner lock (poolloader.shm.backend)."""
        mapping, fd, inode = create(nbytes, "the control block", "control", reserve=True)
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

    def create(self, slot: int, generation: int, nbytes: int, what: str,
               written: int | None = None):
        """(mapping, descriptor, inode, release key) of a new slot segment. Checked
        against the memory available first: under a cgroup limit, pages that are not
        there may wake the OOM killer instead of failing. Its pages are charged as
        written, so a growth is checked for the batch its worker will write
        (`written`), not for the headroom above it (a growth in a cgroup near its
        limit was refused for pages nobody would write)."""
        SPACE.check(nbytes if written is None else min(nbytes, page_round(written)), what)
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
            raise PoolGone(f"PoolLoader worker: the pool's control segment (descriptor {fd} "
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

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
