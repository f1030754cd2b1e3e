"""Datasets for test_robustness.py; a module of their own so workers under any start
method can import them (and the descriptor-limit child can set its limit first)."""
from __future__ import annotations

import os
import threading
import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def _shard():
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class PidStream(IterableDataset):
    """Worker w yields [i, its pid, w] for i = w, w + W, ..., `delay` seconds apart."""

    def __init__(self, n=100_000, delay=0.01):
        self.n = n
        self.delay = delay

    def __iter__(self):
        wid, nw = _shard()
        for i in range(wid, self.n, nw):
            time.sleep(self.delay)
            yield torch.tensor([i, os.getpid(), wid])


class FlakyIterStream(IterableDataset):
    """`__iter__` raises on its first `fail_calls` calls in each copy (each worker's own).

    `eager`: `__iter__` itself raises, before returning an iterator (the fetcher's
    `iter(dataset)` fails). Otherwise `__iter__` is a generator function, so the raise
    comes at the first `next()`.
    """

    def __init__(self, n=14, fail_calls=1, eager=True):
        self.n = n
        self.fail_calls = fail_calls
        self.eager = eager
        self.calls = 0

    def __iter__(self):
        self.calls += 1
        if self.eager:
            self._check(self.calls)
            return self._items(None)
        return self._items(self.calls)

    def _check(self, call):
        if call <= self.fail_calls:
            raise ValueError(f"__iter__ failed (call {call} in this copy)")

    def _items(self, call):
        if call is not None:
            self._check(call)
        wid, nw = _shard()
        for i in range(wid, self.n, nw):
            yield torch.tensor([i, wid])


class RaisingStream(IterableDataset):
    """Worker 0's generator raises after `after` items; the other workers run to the end."""

    def __init__(self, n=16, after=2):
        self.n = n
        self.after = after

    def __iter__(self):
        wid, nw = _shard()
        for k, i in enumerate(range(wid, self.n, nw)):
            if wid == 0 and k == self.after:
                raise KeyError(f"stream broke at item {i}")
            yield torch.tensor([i])


def unpicklable(kind):
    """An object pickle refuses: a lock, or a lambda."""
    if kind == "lock":
        return threading.Lock()
    return lambda x: x


class UnpicklableSample(Dataset):
    """Sample 3 carries an object pickle refuses."""

    def __init__(self, kind, n=8):
        self.kind = kind
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([i]), "extra": unpicklable(self.kind) if i == 3 else None}


class UnpicklableStream(IterableDataset):
    """Item 3 carries an object pickle refuses; the stream goes on after it."""

    def __init__(self, kind, n=8):
        self.kind = kind
        self.n = n

    def __iter__(self):
        wid, nw = _shard()
        for i in range(wid, self.n, nw):
            yield {"x": torch.tensor([i]), "extra": unpicklable(self.kind) if i == 3 else None}


class SparseSamples(Dataset):
    """Each sample holds a sparse COO tensor (a fallback-pickled object whose
    indices and values travel as views of the slot)."""

    def __len__(self):
        return 60

    def __getitem__(self, i):
        return {"x": torch.tensor([i]),
                "sparse": torch.sparse_coo_tensor([[0, 2]], [float(i), 2.0], (3,))}


class CollectingDataset(Dataset):
    """Runs the cyclic GC in the worker on every item: whatever the worker inherited
    as garbage from its parent gets finalised there, if the GC may touch it."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        import gc

        gc.collect()
        return torch.full((1000,), float(i))


class TaggedSamples(Dataset):
    """Every value of sample i is `tag * 1000 + i`: a batch from another loader (another
    tag) or another slot (another i) cannot pass for this one."""

    def __init__(self, tag, n=40):
        self.tag = tag
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        value = self.tag * 1000 + i
        return {"index": i, "tag": self.tag, "name": f"tag{self.tag}-sample{i}",
                "image": torch.full((3, 16, 16), float(value), dtype=torch.float64)}


class StallsAfter(Dataset):
    """Samples below `fast` come at once; every later one takes `stall` seconds, so a
    worker asked for it is busy (and not leaving) for that long. With `marks` (a
    directory), a worker that starts a stall first leaves a file there, so a test can
    wait until the workers are busy rather than hope they are."""

    def __init__(self, fast=2, stall=20.0, n=40, marks=None):
        self.fast, self.stall, self.n, self.marks = fast, stall, n, marks

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.fast:
            if self.marks is not None:
                open(os.path.join(self.marks, f"stalls-{i}"), "w").close()
            time.sleep(self.stall)
        return torch.full((100_000,), float(i))
