"""Fork safety, in one place: what a child of `os.fork()` inherits from a process
that runs pools, and the two at-fork hooks that decide it.

A fork from main (another loader's workers, a user's `os.fork()`, a subprocess helper
forked from a thread) must not pin or keep alive what belongs to main's pools, yet a
batch the user holds is the user's, and a forked child may read it as it could read a
DataLoader batch:

* before the fork (`share_leased_with_children`, in poolloader.shm._shm): main's slot
  mappings are MADV_DONTFORK, so the child inherits none of them, except those a live
  lease views (a delivered batch still held): DONTFORK is cleared on those and they are
  marked `forked`, and the ledger never reuses a forked mapping for another batch;
* after the fork, in the child (`_close_inherited`): every descriptor main keeps for a
  pool (the owner lock over the control segment, memfd segments not yet opened by
  every worker, a start-up payload) is closed at once, so a long-lived child neither
  keeps a dead main's pool "alive" nor holds its memory. A raw C fork() without exec
  runs neither hook.

Everything in poolloader that keeps such a descriptor creates it inside `creating()`
and registers it there with `hold`, and closes it with `release`. The registry is
atomic with both: `creating()` and `release` hold the registry's lock, and so does a
fork (taken by the before-fork hook, released on both sides after it), so a fork from
another thread happens either before the descriptor exists or after it is recorded,
and either before a release or after the number is closed and forgotten: a child never
keeps a descriptor created but not yet recorded, nor closes a reused number that is
still recorded. (The lock is reentrant: a fork from a signal handler that interrupted
the registering thread inside the lock does not deadlock; that one fork is not atomic.)
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from poolloader.shm._shm import share_leased_with_children

_held_fds: set[int] = set()  # descriptors this process keeps for its live pools
_lock = threading.RLock()  # over _held_fds, the creations and releases; held across a fork


@contextlib.contextmanager
def creating() -> Iterator[None]:
    """Create a pool descriptor and `hold` it inside this block: no fork comes between."""
    with _lock:
        yield


def hold(fd: int) -> None:
    """Record a descriptor main keeps for a pool, so that a child of os.fork() closes
    its copy at once. Call it inside `creating()`, with the call that made `fd`."""
    with _lock:
        _held_fds.add(fd)


def release(fd: int, close=None) -> None:
    """Close a descriptor recorded with `hold` (an owner lock goes with it). `close`:
    what closes it, for a descriptor an object owns (`close(fd)`); os.close by default."""
    with _lock:
        _held_fds.discard(fd)
        (close or os.close)(fd)


def _before_fork() -> None:
    _lock.acquire()
    share_leased_with_children()


def _after_in_parent() -> None:
    _lock.release()


def _close_inherited() -> None:
    for fd in _held_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()
    _lock.release()  # this thread took it before the fork: it is the child's only one


os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent,
                    after_in_child=_close_inherited)
