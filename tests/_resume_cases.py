"""Loaders and datasets of tests/test_resume.py, importable by its child process.

A case is a name → keyword arguments for `make_loader`. `canon` turns a batch into
plain bytes and numbers (no view of a slot survives it, and torch.load with
weights_only=True reads it back).
"""
from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loader_datasets import AugmentDataset  # noqa: E402

from poolloader import PoolLoader  # noqa: E402


class AugmentStream(IterableDataset):
    """Worker w yields items w, w+W, ... of range(n), each with draws from torch,
    numpy and random (a random augmentation). `__iter__` draws too (a per-epoch
    shuffle of the worker's share), so the state at iter() matters."""

    def __init__(self, n=41):
        self.n = n

    def _share(self):
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(w, self.n, nw))
        random.Random(torch.randint(0, 1 << 30, ()).item()).shuffle(mine)
        return mine

    def _item(self, i):
        return {"index": i, "t": torch.rand(3) + i, "np": np.random.rand(2), "py": random.random()}

    def __iter__(self):
        for i in self._share():
            yield self._item(i)


class StatefulAugmentStream(AugmentStream):
    """The same stream, resumable through state_dict()/load_state_dict() (its
    position in the worker's share, and the share's shuffle seed)."""

    def __init__(self, n=41):
        super().__init__(n)
        self.seed = None
        self.pos = 0

    def __iter__(self):
        if self.seed is None:
            self.seed = torch.randint(0, 1 << 30, ()).item()
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(w, self.n, nw))
        random.Random(self.seed).shuffle(mine)
        while self.pos < len(mine):
            self.pos += 1
            yield self._item(mine[self.pos - 1])
        self.seed, self.pos = None, 0  # the next epoch shuffles anew

    def state_dict(self):
        return {"seed": self.seed, "pos": self.pos}

    def load_state_dict(self, state):
        self.seed, self.pos = state["seed"], state["pos"]


DATASETS = {"augment": AugmentDataset, "stream": AugmentStream, "stateful_stream": StatefulAugmentStream}


def make_loader(loader="pool", dataset="augment", n=37, generator=None, **kw):
    """A PoolLoader (or torchdata's StatefulDataLoader, or DataLoader) over a test dataset."""
    ds = DATASETS[dataset](n)
    if isinstance(kw.get("batch_sampler"), int):  # torch's own, sequential: any loader fast-forwards it
        kw["batch_sampler"] = torch.utils.data.BatchSampler(
            torch.utils.data.SequentialSampler(ds), kw["batch_sampler"], False)
    if generator is not None:
        kw["generator"] = torch.Generator().manual_seed(generator)
    if loader == "pool":
        return PoolLoader(ds, **kw)
    if loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(ds, **kw)
    return torch.utils.data.DataLoader(ds, **kw)


def canon(batch):
    """A comparable copy of a batch: (key, dtype, shape, bytes) per entry."""
    out = []
    for key in sorted(batch):
        v = batch[key]
        if isinstance(v, torch.Tensor):
            v = v.contiguous()
            out.append((key, str(v.dtype), tuple(v.shape), v.numpy().tobytes()))
        else:
            out.append((key, type(v).__name__, (), repr(v).encode()))
    return tuple(out)


def indices(batches):
    """The sample indices of canonical batches, batch by batch."""
    found = []
    for batch in batches:
        for key, _dtype, _shape, data in batch:
            if key == "index":
                found.append(np.frombuffer(data, dtype=np.int64).tolist())
    return found


class StateFailsDataset(torch.utils.data.Dataset):
    """A map-style dataset whose state_dict() raises once it has served item `bad`."""

    def __init__(self, n=12, bad=5):
        self.n, self.bad, self.served = n, bad, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.served.append(i)
        return torch.tensor([i])

    def state_dict(self):
        if self.bad in self.served:
            raise ValueError(f"state of item {self.bad} cannot be saved")
        return {"served": list(self.served)}

    def load_state_dict(self, state):
        self.served = list(state["served"])
