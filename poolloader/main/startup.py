"""Worker start-up under spawn and forkserver, main's side: what every worker needs,
pickled once into an anonymous shared segment (poolloader.worker.startup, the module
docstring there, tells the whole design; its `load` is the workers' side).
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
    gets instead (poolloader.worker.startup.load). `close()` (idempotent) releases main's descriptor."""

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
    instead (poolloader.worker.startup's docstring): any error pickling it here."""
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
