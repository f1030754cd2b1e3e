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
mapping of it lives (_Source), and the loads of one rank's logical workers compare its
bytes once.

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


def load(ticket: tuple, across_ranks: dict | None = None) -> Any:
    """Worker side: unpickle the payload main shared (SharedStart.ticket), its
    out-of-band buffers viewing a private mapping of main's segment (module docstring).
    `across_ranks` (a node pool's process): a buffer equal to one of another payload this
    process maps views that payload's segment instead. The dict keeps, per payload,
    where each of its buffers was found, so that the loads of one payload (a rank's
    logical workers in this process) compare its bytes once: give the same dict to
    loads made one after another, while their payloads' owners keep them (a dict
    kept longer could meet a new segment under a freed one's inode)."""
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
    if across_ranks is None:
        os.close(own)
        return pickle.loads(view[:nbytes], buffers=[view[offset:offset + n] for offset, n in spans])
    try:
        found = _Found(across_ranks.setdefault(inode, {}), inode, view, spans)
        payload = pickle.loads(view[:nbytes], buffers=found.buffers)
    except BaseException:
        os.close(own)
        raise
    found.keep(mapping, own, size)  # only now: a load that failed registers nothing
    return payload


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

    def __init__(self, fd: int, inode: int, size: int, keys: list):
        self.fd, self.inode, self.size = fd, inode, size
        self.keys = keys  # its entries in _FOUND
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


class _Found:
    """The buffers of one load(across_ranks=...): each a view of another segment's equal
    buffer where there is one (in a mapping made for this load: a write shows in no
    other load's arrays), else of this segment's own; `keep` then records, for the
    loads after it, this segment's buffers found nowhere (unless it is known already:
    another logical worker of the same rank loaded it)."""

    def __init__(self, decided: dict, inode: int, view: memoryview, spans):
        self.inode = inode
        self.mappings: dict[_Source, Any] = {}  # another segment -> its mapping for this load
        self.unfound: list[tuple[tuple, int]] = []  # (key, offset) of buffers found nowhere
        # each (segment, offset) found serves one buffer of a load, so two equal arrays
        # of one payload stay two arrays, not views of the same bytes
        taken: set[tuple[int, int]] = set()
        self.buffers = []
        for offset, n in spans:
            mine = view[offset:offset + n]
            where = decided.get(offset)
            if where is None or (where[0] is not None and where[0].fd < 0):
                # not compared yet, or the source found then is gone
                where = decided[offset] = self._find(mine, taken)
            found = None
            if where[0] is not None:
                found = self._view(where[0], where[1], n)
            if found is None:
                self.unfound.append((where[2], offset))
            else:
                taken.add((where[0].inode, where[1]))
            self.buffers.append(mine if found is None else found)

    def _find(self, mine: memoryview, taken: set) -> tuple:
        """(source, offset there, key) of a buffer equal to `mine` in another segment
        this process keeps (not `taken` by this load), or (None, 0, key)."""
        key = _key(mine)
        for other, at in _FOUND.get(key, ()):
            if other.inode == self.inode or other.fd < 0 or (other.inode, at) in taken:
                continue
            candidate = self._view(other, at, mine.nbytes)
            if candidate is not None and _same_bytes(mine, candidate):
                return other, at, key
        return None, 0, key

    def _view(self, other: _Source, at: int, n: int) -> memoryview | None:
        theirs = self.mappings.get(other)
        if theirs is None:
            try:
                theirs = self.mappings[other] = memfd.map_private(other.fd, other.size)
            except OSError:  # no mapping to spare (ENOMEM, a map count limit): this
                return None  # load keeps its own copy
        return memoryview(theirs)[at:at + n]

    def keep(self, mapping, own: int, size: int) -> None:
        """After a successful load: the other segments' mappings it uses are watched,
        and this segment is recorded (its descriptor kept) if any buffer of it was found
        nowhere and it is not known yet; else its descriptor is closed."""
        for other, theirs in self.mappings.items():
            other.watch(theirs)
        if self.unfound and self.inode not in _SOURCES:
            source = _Source(own, self.inode, size, [key for key, _ in self.unfound])
            for key, offset in self.unfound:
                _FOUND.setdefault(key, []).append((source, offset))
            _SOURCES[self.inode] = source
            source.watch(mapping)
        else:
            os.close(own)


def untyped_storage(buffer: Any) -> torch.UntypedStorage:
    """A CPU storage over `buffer` (no copy; it holds the buffer alive): how the stream
    rebuilds a storage main carried out of band (poolloader.main.startup)."""
    if not memoryview(buffer).nbytes:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def typed_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.storage.TypedStorage:
    """The TypedStorage `storage` was pickled from (as torch.load rebuilds one)."""
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
