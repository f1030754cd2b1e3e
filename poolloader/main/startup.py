"""Worker start-up under spawn and forkserver, main's side: what every worker needs,
pickled once into an anonymous shared segment, its arrays out of band on their own
pages (poolloader.worker.startup, the module docstring there, tells the whole design;
its `load` is the workers' side).

The segment's layout: the pickle stream (protocol 5) from offset 0, then each
out-of-band buffer at the next page boundary, in the order the stream refers to them;
SharedStart.ticket lists every buffer's (offset, length).
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any

import numpy as np
import torch

from poolloader.shm import fork
from poolloader.shm.backend import PAGE, retire
from poolloader.shm.backends import memfd
from poolloader.worker import zygote
from poolloader.worker.startup import OUT_OF_BAND_BYTES, typed_storage, untyped_storage


class _ArraysApart(pickle.Pickler):
    """Pickle protocol 5, with every large buffer out of band (the worker module's
    docstring): numpy's arrays give theirs (PickleBuffer); a CPU torch storage is
    pickled as its bytes in a PickleBuffer, one per storage however many tensors
    view it. Anything else, and any storage this cannot rebuild exactly as torch
    would (not CPU, a legacy typed storage class), pickles as plain pickle does.
    A tensor whose dtype TypedStorage lacks pickles as torch pickles it, its
    storage given to torch's rebuild as torch.load would give it (plain pickling's
    stream of one does not load: torch.load needs a dtype for its storage)."""

    def __init__(self, file: io.BytesIO):
        self.buffers: list[pickle.PickleBuffer] = []
        super().__init__(file, protocol=5, buffer_callback=self._apart)
        # one UntypedStorage object per storage, so pickle's memo keeps views that
        # share one storage sharing it in the worker; kept alive here so no id is reused
        self._storages: dict[int, torch.UntypedStorage] = {}

    def _apart(self, buffer: pickle.PickleBuffer) -> bool:
        """buffer_callback: False (out of band) for a buffer of OUT_OF_BAND_BYTES or more."""
        if buffer.raw().nbytes < OUT_OF_BAND_BYTES:
            return True
        self.buffers.append(buffer)
        return False

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.storage.TypedStorage:
            untyped = obj._untyped_storage  # as torch's own Tensor.__reduce_ex__ reads it
            if untyped.device.type == "cpu" and untyped.nbytes() >= OUT_OF_BAND_BYTES:
                return typed_storage, (self._canonical(untyped), obj.dtype)
        elif type(obj) is torch.UntypedStorage:
            # any size: torch.load cannot rebuild an UntypedStorage that pickled itself
            # (it needs a dtype); a small one's buffer goes in band (_apart)
            if obj.device.type == "cpu":
                canonical = self._canonical(obj)
                if canonical is not obj:
                    return _same, (canonical,)
                raw: Any = torch.empty(0, dtype=torch.uint8).set_(obj).numpy()  # a buffer exporter
                return untyped_storage, (pickle.PickleBuffer(raw),)
        elif isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            # a dtype TypedStorage lacks (uint16, uint32, uint64, float8...): torch
            # pickles the tensor with its UntypedStorage, which _rebuild_tensor_v3 reads
            # as torch.load gives it, a TypedStorage; so give it one (of bytes)
            reduced = obj.__reduce_ex__(5)
            if reduced[0] is _REBUILD_V3 and type(reduced[1][0]) is torch.UntypedStorage:
                storage = typed_storage(reduced[1][0], torch.uint8)
                return (reduced[0], (storage,) + tuple(reduced[1][1:])) + tuple(reduced[2:])
            return reduced
        return NotImplemented

    def _canonical(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        return self._storages.setdefault(id(storage), storage)


_REBUILD_V3 = torch._utils._rebuild_tensor_v3


def _same(obj: Any) -> Any:
    """Rebuilds a storage pickled before under another Python object (its memo entry)."""
    return obj


class SharedStart:
    """Main side: `payload` pickled once into a segment (module docstring); `ticket` is
    what each worker gets instead (poolloader.worker.startup.load). `close()`
    (idempotent) releases main's descriptor. Costs one copy of every out-of-band
    buffer, into the segment; main keeps no mapping of it."""

    def __init__(self, payload: Any):
        stream = io.BytesIO()
        pickler = _ArraysApart(stream)
        pickler.dump(payload)
        blob = stream.getbuffer()
        spans, end = [], len(blob)
        for buffer in pickler.buffers:
            offset = (end + PAGE - 1) // PAGE * PAGE
            spans.append((offset, buffer.raw().nbytes))
            end = offset + buffer.raw().nbytes
        mapping, fd, inode = memfd.create(max(1, end), "the workers' start arguments",
                                          "start", dontfork=True, reserve=True)
        try:
            memory: Any = mapping  # a buffer exporter (poolloader.shm._shm: no __buffer__ in its stub)
            with memoryview(memory) as target:
                target[:len(blob)] = blob
                for (offset, n), buffer in zip(spans, pickler.buffers):
                    np.frombuffer(target, np.uint8, n, offset)[:] = np.frombuffer(buffer.raw(), np.uint8)
            self.ticket: tuple | None = (os.getpid(), fd, inode, mapping.size, len(blob), tuple(spans))
        except BaseException:
            fork.release(fd)
            raise
        finally:
            retire(mapping)  # main needs no mapping of it
        self._fd: int | None = fd
        self.nbytes = end
        self.out_of_band = sum(n for _, n in spans)

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


def shares(ctx, backend: str = "memfd", hosted: bool = False) -> bool:
    """Whether workers of this multiprocessing context should load their arguments from
    a SharedStart: they are pickled (not fork), the pool's `backend` is memfd (a POSIX
    pool's workers must not need /proc either) and anonymous shared memory works.
    `hosted` (PoolLoader(node_workers=): a process hosts several logical workers): under
    fork too, for the logical workers after the first of each process, which need copies
    of their own (poolloader.worker.loop._own_copies): mapped from the segment, their
    arrays stay one copy, shared copy-on-write, as DataLoader's forked workers share
    main's; a deep copy would give each its own."""
    method = ctx.get_start_method() if hasattr(ctx, "get_start_method") else None
    pickled = ("spawn", "forkserver") + (("fork",) if hosted else ())
    return method in pickled and backend == "memfd" and memfd.supported() is None


def zygote_for(ctx, requested: bool | None, *objects) -> Any:
    """The zygote (poolloader.worker.zygote) that forks this iterator's workers, started
    if it is not running, or None: fork, another start method, or turned off
    (PoolLoader(zygote=False), POOLLOADER_ZYGOTE=0). `objects`: the dataset, collate_fn
    and worker_init_fn, whose modules a new zygote preloads."""
    method = zygote.method_of(ctx)
    if method not in zygote.METHODS or not zygote.enabled(requested):
        return None
    return zygote.get(method, zygote.modules_of(*objects))


def warm(ctx, requested: bool | None, *objects) -> None:
    """As the loader is built: start its zygote now (zygote_for), so that it imports
    while the program builds its model. Not in a process multiprocessing started (a
    worker re-running the main script as __mp_main__ builds loaders it never iterates)."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        zygote_for(ctx, requested, *objects)
