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

Everything in poolloader that keeps such a descriptor registers it with `hold` and
closes it with `release`.
"""
from __future__ import annotations

import os

from poolloader.shm._shm import share_leased_with_children

_held_fds: set[int] = set()  # descriptors this process keeps for its live pools


def hold(fd: int) -> None:
    """Record a descriptor main keeps for a pool, so that a child of os.fork() closes
    its copy at once."""
    _held_fds.add(fd)


def release(fd: int) -> None:
    """Close a descriptor recorded with `hold` (an owner lock goes with it)."""
    _held_fds.discard(fd)
    os.close(fd)


def _close_inherited() -> None:
    for fd in _held_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()


os.register_at_fork(before=share_leased_with_children, after_in_child=_close_inherited)
