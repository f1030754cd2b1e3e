"""Worker start-up under spawn and forkserver: what every worker needs, pickled once,
its arrays mapped, not copied.

A spawn or forkserver worker receives its arguments pickled through its start pipe,
so DataLoader pickles the dataset, `worker_init_fn` and `collate_fn` once per worker
in the main process (pytorch/pytorch #139792): start-up grows with workers × dataset
size, and forkserver is the default start method from Python 3.14. Here main pickles
them once per iterator into an anonymous shared segment (memfd.py), and what crosses
each start pipe is a few integers per array (SharedStart.ticket).

The arrays inside them cross out of band: every numpy array numpy pickles as a
buffer (C- or Fortran-contiguous, no Python objects inside: pickle protocol 5's
PickleBuffer) and every CPU torch storage (tensors, their views, Parameters, subclasses
keep pickling as torch pickles them; only the storage under them is carried apart) of
at least OUT_OF_BAND_BYTES is laid in the segment after the pickle stream, each buffer
on its own page. A worker maps the segment copy-on-write (memfd.open_private:
MAP_PRIVATE, readable and writable) and unpickles with `buffers=` views into that
mapping, so an array or tensor in the worker views the segment's pages without a
copy: every worker reads the same pages of memory, and a dataset of 2 GB of arrays
costs 2 GB once, not once per worker. A worker that writes into one gets its own copy
of the pages it writes, as a forked worker does: no other worker, no later epoch's
workers and not main see the write (under spawn DataLoader unpickles a copy of a numpy
array in each worker, but moves a CPU tensor into torch's shared memory, where a
worker's write is seen by every worker and by main). An array is writable
exactly where the original was (a read-only numpy array stays read-only, as pickle
protocol 5 keeps it). The mapping lives as long as anything views it (each array
holds its buffer), and the segment as long as a worker maps it or main holds its
descriptor. The rest of the stream (Python objects, small arrays, objects that
rebuild themselves from bytes, non-contiguous numpy arrays, which numpy copies into
the stream) is unpickled into each worker's own memory, as before.

Main keeps the segment's descriptor until every worker has replied once (so has
mapped it) and closes it then, or at shutdown; the memory goes with the last worker
that maps it (for persistent workers: when they exit).

Under fork nothing is pickled at all (the child inherits the objects), except for a
process hosting several logical workers (PoolLoader(node_workers=): those after its
first load their own copies from here) and a node pool's processes; and where
anonymous shared memory cannot be used (memfd.supported(): workers cannot open main's
/proc/<pid>/fd), or the pool is POSIX (shm_backend="posix": the user's way out of
/proc), the arguments travel as DataLoader's do. So do arguments that pickle only
while a process is being spawned: multiprocessing's locks, events, queues and
connections (they may be "shared between processes only through inheritance", and a
queue's pipe needs its descriptor passed to each child), and anything else that cannot
be pickled here: the start pipe then says what is wrong, as DataLoader's does.

Main's side (SharedStart, share, shares) is poolloader.main.startup; this module is
the worker's (load, and the two functions the stream calls to rebuild a storage).
"""
from __future__ import annotations

import pickle
from typing import Any

import torch

from poolloader.shm.backends import memfd

# Arrays and storages smaller than this stay in the pickle stream: a buffer out of
# band costs a page of the segment at least (4 KiB of padding on average) and a few
# integers in every worker's ticket, and copying 64 KiB costs a worker about what
# mapping it does. Slot decoding draws the same line (wire.slot_format.SMALL_TENSOR_BYTES).
OUT_OF_BAND_BYTES = 64 << 10


def load(ticket: tuple) -> Any:
    """Worker side: unpickle the payload main shared (SharedStart.ticket), its
    out-of-band buffers viewing a private mapping of main's segment (module docstring)."""
    main_pid, fd, inode, size, nbytes, spans = ticket
    try:
        mapping = memfd.open_private(main_pid, fd, inode, size)
    except memfd.StaleHandle:
        raise RuntimeError(
            f"PoolLoader worker: the start arguments main shared (descriptor {fd} of pid "
            f"{main_pid}) are gone: the main process shut the loader down or exited before "
            "this worker started") from None
    view = memoryview(mapping)
    # every array rebuilt from a buffer holds its view, and so the mapping, alive; once
    # the last is gone the mapping is unmapped (nothing closes it while one lives)
    return pickle.loads(view[:nbytes], buffers=[view[offset:offset + n] for offset, n in spans])


def untyped_storage(buffer: Any) -> torch.UntypedStorage:
    """A CPU storage over `buffer` (no copy; it holds the buffer alive): how the stream
    rebuilds a storage main carried out of band (poolloader.main.startup)."""
    if not memoryview(buffer).nbytes:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def typed_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.storage.TypedStorage:
    """The TypedStorage `storage` was pickled from (as torch.load rebuilds one)."""
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
