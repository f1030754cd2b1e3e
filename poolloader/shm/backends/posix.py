"""Named shared memory: segments in /dev/shm through posix-ipc, and the sweep of
dead owners' names.

The backend of SlotPool's `backend="posix"` (poolloader.shm.backend is the
interface), and the fallback where memfd cannot be used. Every segment is created
exclusively (O_EXCL) with mode 0600 under a name carrying the owner's pid and a
random token, space-checked and reserved (posix_fallocate), and mapped with the
descriptor closed right after (poolloader.shm._shm.Mapping keeps none). SlotPool
(pool.py) decides which segments a pool has; this module knows how one is made,
named, found, judged stale and removed.
Names: /pl2-<owner pid>-<token>-ctl for the control block and
/pl2-<owner pid>-<token>-s<slot>-g<generation> for slots. The pid is only a hint
for people reading /dev/shm: nothing here decides anything by it. "pl2" marks
pools that hold an owner lock (poolloader.shm.backend); the "pl-" names of an older
poolloader, whose sweep judges by pid, are neither judged here nor matched by its
sweep, so two versions sharing a host leave each other alone.

Ownership across jobs: a pid in a name cannot say whether the owner lives (another
PID namespace's, or reused); the owner lock on the control segment does
(poolloader.shm.backend), and every process that shares the tmpfs sees it.

* sweep_stale() (each new pool runs it) removes a pool's names only after taking
  that lock itself, which proves the owner gone: slot names first, the control
  name last, while holding it. Names whose control segment is absent are left
  alone: a pool made here creates its control name first and removes it last,
  so nothing says whose such names are (an older poolloader's, say).
* So the control name stays for the pool's whole life (slot names still go as
  soon as every worker has mapped them).
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
"""
from __future__ import annotations

import os
import re
import secrets

import posix_ipc

from poolloader.errors import PoolGone
from poolloader.shm import fork
from poolloader.shm._shm import Mapping
from poolloader.shm.backend import Space, owner_lock_held, release_owner_lock, take_owner_lock

KIND = "posix"
DESCRIPTION = "named segments in /dev/shm"
SHM_DIR = "/dev/shm"
NAME_TAG = "pl2"  # first part of every name (module docstring)
_POOL_RE = re.compile(rf"^({NAME_TAG}-\d+-[0-9a-f]+)-")  # group 1: a pool's prefix, without "/"
# How many fresh tokens a new pool tries when a sweeper races its control segment.
_CLAIM_TRIES = 8


def supported() -> str | None:
    """None: a process that can import posix_ipc can make named segments."""
    return None


def refuses(max_slots: int) -> str | None:
    """None: a pool of any size keeps one descriptor (the owner lock's)."""
    return None


def control_name(prefix: str) -> str:
    return f"{prefix}-ctl"


def slot_name(prefix: str, slot: int, generation: int) -> str:
    return f"{prefix}-s{slot}-g{generation}"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


SPACE = Space(SHM_DIR, f"Enlarge {SHM_DIR} (Docker: --shm-size=2g or larger; Kubernetes: an "
              "emptyDir with medium: Memory)", lambda: (shm_free_bytes(), f"free in {SHM_DIR}"))


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


def create_segment(name: str, nbytes: int, what: str, dontfork: bool = True) -> Mapping:
    """Create, reserve and map `nbytes` under `name`; the name stays until unlinked.

    Checks free space in /dev/shm first, then reserves the pages with posix_fallocate:
    on tmpfs an unreserved segment would be created fine and kill its first writer
    with SIGBUS once the space runs out. (The pool's cap is SlotPool's to check.)
    """
    mapping, _ = _create(name, nbytes, what, dontfork, claim=False)
    return mapping


def _create(name: str, nbytes: int, what: str, dontfork: bool,
            claim: bool) -> tuple[Mapping, int | None]:
    """create_segment; with `claim`, also take the owner lock and return the locked
    descriptor (the caller keeps it), or raise _NameLost if a sweeper got there first."""
    SPACE.check(nbytes, what)
    with fork.creating():  # no fork between the descriptor's creation and its record
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
        fork.hold(shm.fd)
    keep_fd = False
    try:
        # A sweeper may have opened the name before we locked it: then it holds the
        # lock (we fail to take it) or has already unlinked the name.
        if claim and not (take_owner_lock(shm.fd) and _same_file(SHM_DIR + name, shm.fd)):
            raise _NameLost(name)
        SPACE.reserve(shm.fd, nbytes, what)
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


def claim_control(owner_pid: int, nbytes: int) -> tuple[str, Mapping, int]:
    """A new pool's control segment under a fresh prefix, with its owner lock held:
    (prefix, mapping, locked descriptor). Retries under a new token if a sweeper takes
    the name before the lock (module docstring)."""
    for _ in range(_CLAIM_TRIES):
        prefix = f"/{NAME_TAG}-{owner_pid}-{secrets.token_hex(8)}"
        try:
            mapping, fd = _create(control_name(prefix), nbytes, "the control block",
                                  dontfork=True, claim=True)
        except _NameLost:
            continue
        assert fd is not None  # held since its creation (_create)
        return prefix, mapping, fd
    raise RuntimeError(f"internal error: {_CLAIM_TRIES} new control segments in a row were "
                       "unlinked by other processes before this one could lock them")


# -- the backend objects SlotPool and WorkerSlots use ---------------------------------

class Segments:
    """Main side of the POSIX backend: named segments in /dev/shm (module docstring).

    The pool's names are the prefix's; a slot segment's name is released (unlinked)
    once every worker has mapped it, the control name (owner lock) at close()."""

    kind = KIND
    charged_as_written = False  # MainSide

    def __init__(self, owner_pid: int):
        self.owner_pid = owner_pid
        self.prefix = ""  # set by claim_control
        self._control_name = ""
        self._lock_fd: int | None = None
        self._names: set[str] = set()  # every name not yet unlinked

    def check_space(self, nbytes: int, what: str) -> None:
        SPACE.check(nbytes, what)

    def claim_control(self, nbytes: int) -> Mapping:
        sweep_stale()
        self.prefix, mapping, self._lock_fd = claim_control(self.owner_pid, nbytes)
        self._control_name = control_name(self.prefix)
        self._names.add(self._control_name)
        return mapping

    @property
    def locator(self) -> tuple:
        """What a worker needs to attach (picklable)."""
        return (self.kind, self.prefix)

    def create(self, slot: int, generation: int, nbytes: int, what: str,
               written: int | None = None):
        """(mapping, handle a, handle b, release key) of a new slot segment, reserved
        whole now (so checked for all `nbytes`, whatever is `written`: MainSide.create)."""
        name = slot_name(self.prefix, slot, generation)
        mapping = create_segment(name, nbytes, what)
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


class Attachment:
    """Worker side of the POSIX backend: the control segment mapped by name, and the
    descriptor that answers whether main's owner lock is still held."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        try:
            shm = posix_ipc.SharedMemory(control_name(prefix))
        except posix_ipc.ExistentialError:  # main closed the pool (or died and was swept)
            raise PoolGone(f"PoolLoader worker: the pool's control segment "
                           f"{control_name(prefix)} is gone: the main process closed the "
                           "pool or exited before this worker started") from None
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

    def close(self) -> None:
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)
