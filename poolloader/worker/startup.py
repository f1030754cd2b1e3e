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

Main keeps the segment's descriptor until every worker has loaded it (marked in the
control block as the worker is built, WORKER_LOADED, and read at each reply; a reply
says so too) and closes it then, or at shutdown; the memory goes with the last worker
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

A node pool's process (poolloader.worker.node) loads one payload per rank, and the
local ranks of a job usually build the same dataset: each rank's payload then carries
the same arrays again, a copy per rank in shared memory. Such a process loads with
`across_ranks`: an out-of-band buffer whose bytes equal, byte for byte, a buffer of
another rank's payload it maps already is viewed in a private mapping of that
payload's segment instead of its own, so the node keeps one copy, and a rank's segment
whose every buffer was found elsewhere is mapped by nobody once it is unpickled: it
goes when its rank closes its descriptor. Each load still has mappings of its own
(copy-on-write), so a write by one rank's worker shows in no other's, as each
DataLoader worker has its own copy. Candidates are found by length and a checksum of
each buffer's first and last pages, and compared whole before one is used; the
process keeps a descriptor of a segment whose buffers may be found this way while any
mapping of it lives (_Source).

Main's side (SharedStart, share, shares) is poolloader.main.startup; this module is
the worker's (load, and the two functions the stream calls to rebuild a storage).
"""
from __future__ import annotations

import os
import pickle
import weakref
import zlib
from typing import Any

import numpy as np
import torch

from poolloader.shm.backends import memfd

# Arrays and storages smaller than this stay in the pickle stream: a buffer out of
# band costs a page of the segment at least (4 KiB of padding on average) and a few
# integers in every worker's ticket, and copying 64 KiB costs a worker about what
# mapping it does. Slot decoding draws the same line (wire.slot_format.SMALL_TENSOR_BYTES).
OUT_OF_BAND_BYTES = 64 << 10


def load(ticket: tuple, across_ranks: bool = False) -> Any:
    """Worker side: unpickle the payload main shared (SharedStart.ticket), its
    out-of-band buffers viewing a private mapping of main's segment (module docstring).
    `across_ranks` (a node pool's process): a buffer equal to one of another payload this
    process maps views that payload's segment instead."""
    main_pid, fd, inode, size, nbytes, spans = ticket
    try:
        mapping, own = memfd.open_private(main_pid, fd, inode, size, keep_fd=True)
    except memfd.StaleHandle:
        raise RuntimeError(
            f"PoolLoader worker: the start arguments main shared (descriptor {fd} of pid "
            f"{main_pid}) are gone: the main process shut the loader down or exited before "
            "this worker started") from None
    view = memoryview(mapping)
    # every array rebuilt from a buffer holds its view, and so the mapping, alive; once
    # the last is gone the mapping is unmapped (nothing closes it while one lives)
    if across_ranks:
        buffers = _found_elsewhere(mapping, own, inode, size, view, spans)
    else:
        os.close(own)
        buffers = [view[offset:offset + n] for offset, n in spans]
    return pickle.loads(view[:nbytes], buffers=buffers)


# what identifies a candidate: the buffer's length and checksums of its first and last
# SAMPLE bytes (every out-of-band buffer is at least OUT_OF_BAND_BYTES long)
SAMPLE = 4096
# bytes compared at a time (numpy makes a boolean array of as many)
COMPARE_BYTES = 1 << 20


class _Source:
    """A payload's segment this process maps, whose buffers a later load across ranks
    may view: this process's descriptor of it, kept while any mapping of it made here
    lives (`watch`), then closed and forgotten (so the segment can go)."""

    __slots__ = ("fd", "inode", "size", "keys", "live", "__weakref__")

    def __init__(self, fd: int, inode: int, size: int):
        self.fd, self.inode, self.size = fd, inode, size
        self.keys: list[tuple] = []  # its entries in _FOUND
        self.live = 0

    def watch(self, mapping) -> None:
        self.live += 1
        weakref.finalize(mapping, self._unmapped)

    def _unmapped(self) -> None:
        self.live -= 1
        if self.live or self.fd < 0:
            return
        for key in self.keys:
            entries = [e for e in _FOUND.get(key, ()) if e[0] is not self]
            if entries:
                _FOUND[key] = entries
            else:
                _FOUND.pop(key, None)
        _SOURCES.pop(self.inode, None)
        fd, self.fd = self.fd, -1
        os.close(fd)


# key (length, checksums) -> [(source, offset of the buffer in its segment)]
_FOUND: dict[tuple, list[tuple[_Source, int]]] = {}
_SOURCES: dict[int, _Source] = {}  # inode -> its source


def _forget_in_child() -> None:
    """A forked child holds copies of the descriptors: closed, and nothing is found."""
    for source in _SOURCES.values():
        if source.fd >= 0:
            os.close(source.fd)
            source.fd = -1
    _SOURCES.clear()
    _FOUND.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _key(buffer: memoryview) -> tuple:
    return (buffer.nbytes, zlib.crc32(buffer[:SAMPLE]), zlib.crc32(buffer[-SAMPLE:]))


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    x, y = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    return all(np.array_equal(x[i:i + COMPARE_BYTES], y[i:i + COMPARE_BYTES])
               for i in range(0, len(x), COMPARE_BYTES))


def _found_elsewhere(mapping, own: int, inode: int, size: int, view: memoryview,
                     spans) -> list:
    """The buffers for load(across_ranks=True): each a view of another segment's equal
    buffer where there is one (in a mapping made for this load), else of this one's; the
    buffers of a segment not known yet are recorded for the loads after this one."""
    known = _SOURCES.get(inode)  # this very segment, loaded before (another logical worker)
    source = _Source(own, inode, size) if known is None else None
    elsewhere: dict[_Source, Any] = {}  # another segment -> its mapping for this load
    # (segment, offset) of the buffers found so far: each serves one buffer of a load,
    # so two equal arrays of one payload stay two arrays, not views of the same bytes
    taken: set[tuple[int, int]] = set()
    buffers = []
    try:
        for offset, n in spans:
            mine = view[offset:offset + n]
            key = _key(mine)
            found = None
            for other, at in _FOUND.get(key, ()):
                if other.inode == inode or other.fd < 0 or (other.inode, at) in taken:
                    continue
                theirs = elsewhere.get(other)
                if theirs is None:
                    try:
                        theirs = elsewhere[other] = memfd.map_private(other.fd, other.size)
                    except OSError:  # no mapping to spare (ENOMEM, a map count limit)
                        continue     # this load keeps its own copy
                candidate = memoryview(theirs)[at:at + n]
                if _same_bytes(mine, candidate):
                    found = candidate
                    taken.add((other.inode, at))
                    break
                candidate.release()
            if found is None and source is not None:
                source.keys.append(key)
                _FOUND.setdefault(key, []).append((source, offset))
            buffers.append(mine if found is None else found)
    except BaseException:
        for key in source.keys if source is not None else ():
            _FOUND[key] = [e for e in _FOUND[key] if e[0] is not source]
        os.close(own)
        raise
    for other, theirs in elsewhere.items():
        other.watch(theirs)
    if source is not None and source.keys:
        _SOURCES[inode] = source
        source.watch(mapping)
    else:
        os.close(own)
    return buffers


def untyped_storage(buffer: Any) -> torch.UntypedStorage:
    """A CPU storage over `buffer` (no copy; it holds the buffer alive): how the stream
    rebuilds a storage main carried out of band (poolloader.main.startup)."""
    if not memoryview(buffer).nbytes:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def typed_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.storage.TypedStorage:
    """The TypedStorage `storage` was pickled from (as torch.load rebuilds one)."""
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
