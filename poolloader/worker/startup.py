"""Worker start-up under spawn and forkserver: what every worker needs, pickled once.

A spawn or forkserver worker receives its arguments pickled through its start pipe,
so DataLoader pickles the dataset, `worker_init_fn` and `collate_fn` once per worker
in the main process (pytorch/pytorch #139792): start-up grows with workers × dataset
size, and forkserver is the default start method from Python 3.14. Here main pickles
them once per iterator into an anonymous shared segment (memfd.py) and each worker
unpickles its own copy from there, in parallel; what crosses each start pipe is a
few integers. Main keeps the segment's descriptor until every worker has replied once
(so has loaded it) and closes it then, or at shutdown; the memory goes with the last
process that maps it.

Under fork nothing is pickled at all (the child inherits the objects), and where
anonymous shared memory cannot be used (memfd.supported(): workers cannot open main's
/proc/<pid>/fd), or the pool is POSIX (shm_backend="posix": the user's way out of
/proc), the arguments travel as DataLoader's do. So do arguments that pickle only
while a process is being spawned: multiprocessing's locks, events, queues and
connections (they may be "shared between processes only through inheritance", and a
queue's pipe needs its descriptor passed to each child), and anything else that cannot
be pickled here: the start pipe then says what is wrong, as DataLoader's does.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

from poolloader.shm import fork
from poolloader.shm.backend import retire
from poolloader.shm.backends import memfd


class SharedStart:
    """Main side: `payload` pickled once into a segment; `ticket` is what each worker
    gets instead (startup.load). `close()` (idempotent) releases main's descriptor."""

    def __init__(self, payload: Any):
        blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        mapping, fd, inode = memfd.create(max(1, len(blob)), "the workers' start arguments",
                                          "start", dontfork=True)
        try:
            buffer: Any = mapping  # a buffer exporter (poolloader.shm._shm: no __buffer__ in its stub)
            np.frombuffer(buffer, np.uint8, count=len(blob))[:] = np.frombuffer(blob, np.uint8)
            self.ticket: tuple | None = (os.getpid(), fd, inode, mapping.size, len(blob))
        except BaseException:
            fork.release(fd)
            raise
        finally:
            retire(mapping)  # main needs no mapping of it
        self._fd: int | None = fd
        self.nbytes = len(blob)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fork.release(fd)


def share(payload: Any) -> SharedStart | None:
    """A SharedStart of `payload`, or None where it must travel with each worker's start
    instead (module docstring): any error pickling it here."""
    try:
        return SharedStart(payload)
    except Exception:
        return None


def shares(ctx, backend: str = "memfd") -> bool:
    """Whether workers of this multiprocessing context should load their arguments from
    a SharedStart: they are pickled (not fork), the pool's `backend` is memfd (a POSIX
    pool's workers must not need /proc either) and anonymous shared memory works."""
    method = ctx.get_start_method() if hasattr(ctx, "get_start_method") else None
    return method in ("spawn", "forkserver") and backend == "memfd" and memfd.supported() is None


def load(ticket: tuple) -> Any:
    """Worker side: unpickle the payload main shared (SharedStart.ticket)."""
    main_pid, fd, inode, size, nbytes = ticket
    try:
        mapping = memfd.open_segment(main_pid, fd, inode, size)
    except memfd.StaleHandle:
        raise RuntimeError(
            f"PoolLoader worker: the start arguments main shared (descriptor {fd} of pid "
            f"{main_pid}) are gone: the main process shut the loader down or exited before "
            "this worker started") from None
    try:
        buffer: Any = mapping
        with memoryview(buffer) as view:
            return pickle.loads(view[:nbytes])
    finally:
        retire(mapping)
