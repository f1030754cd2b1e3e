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

Main's side (SharedStart, share, shares) is poolloader.main.startup; this module is
the worker's (load).
"""
from __future__ import annotations

import pickle
from typing import Any

from poolloader.shm.backend import retire
from poolloader.shm.backends import memfd


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
