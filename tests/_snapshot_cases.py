"""Datasets of tests/test_resume_snapshots.py, importable by spawned workers.

Each one's output depends on its whole history in the worker (a state that changes
with every fetch, fed by random draws), so a resume that skips, repeats or reorders
a replayed fetch, or replays it in the wrong random state, shows in the batches.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from _resume_cases import StatefulAugmentStream
from torch.utils.data import Dataset


def _draws(i: int, acc: float) -> dict:
    return {"index": i, "t": torch.rand(3) + i, "np": np.random.rand(2), "py": random.random(),
            "acc": acc}


class HistoryDataset(Dataset):
    """Map-style with state_dict(): a fetch count and an accumulator of random draws."""

    def __init__(self, n=37):
        self.n, self.count, self.acc = n, 0, 0.0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.count += 1
        self.acc = self.acc * 0.5 + random.random() + self.count
        return _draws(i, self.acc)

    def state_dict(self):
        return {"count": self.count, "acc": self.acc}

    def load_state_dict(self, state):
        self.count, self.acc = state["count"], state["acc"]


class HistoryModule(torch.nn.Module, Dataset):
    """A dataset that is an nn.Module: its state_dict() is its buffers (`weight`, and a
    `served` counter that every fetch changes)."""

    def __init__(self, n=37, weight_bytes=4096):
        torch.nn.Module.__init__(self)
        self.n = n
        self.register_buffer("weight", torch.zeros(weight_bytes // 4))
        self.register_buffer("served", torch.zeros((), dtype=torch.int64))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.served += 1
        self.weight[0] += torch.rand(())
        return _draws(i, float(self.weight[0]) + int(self.served))


class HistoryStream(StatefulAugmentStream):
    """Worker w yields a shuffled share of range(n) (shuffled in __iter__, from the RNG:
    tests/_resume_cases.py's resumable stream) with an accumulator fed by every item;
    resumable through state_dict()/load_state_dict()."""

    def __init__(self, n=41):
        super().__init__(n)
        self.acc = 0.0

    def _item(self, i):
        self.acc = self.acc * 0.5 + random.random()
        return _draws(i, self.acc)

    def state_dict(self):
        return {**super().state_dict(), "acc": self.acc}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.acc = state["acc"]


class CallCounter(Dataset):
    """Counts its state_dict() calls in its state: which batches carried a snapshot."""

    def __init__(self, n=40):
        self.n, self.calls = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])

    def state_dict(self):
        self.calls += 1
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


DATASETS = {"map": HistoryDataset, "module": HistoryModule, "stream": HistoryStream}
