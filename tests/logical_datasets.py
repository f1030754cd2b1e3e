"""Datasets for the node_workers tests (tests/test_logical_workers.py); a module of its
own so spawned workers can import them. Each draws from torch, numpy and random in
worker_init_fn and per sample, so a logical worker run in another's state shows."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def augment_init(worker_id):
    """A worker_init_fn that changes its worker's copy of the dataset, drawing from
    every RNG: a logical worker sharing another's copy, or its RNG, gives other values."""
    info = get_worker_info()
    info.dataset.offset = float(torch.rand(1)) + random.random() + float(np.random.rand())
    info.dataset.init_worker = worker_id


class InitAugmentDataset(Dataset):
    def __init__(self, n=29, shape=(2, 3), sleep_at=None, sleep_s=0.0):
        self.n = n
        self.shape = shape
        self.sleep_at, self.sleep_s = sleep_at, sleep_s
        self.offset = 0.0
        self.init_worker = -1

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        if i == self.sleep_at:
            time.sleep(self.sleep_s)
        return {"image": torch.rand(self.shape) + self.offset + i, "np": np.random.rand(2),
                "py": random.random(), "index": i, "worker": info.id,
                "init_worker": self.init_worker, "seed": info.seed,
                "num_workers": info.num_workers}


def shard_init(worker_id):
    """Shards the IterableDataset by worker: its copy keeps only its share."""
    info = get_worker_info()
    info.dataset.start = worker_id
    info.dataset.step = info.num_workers


class ShardedStream(IterableDataset):
    def __init__(self, n=23):
        self.n = n
        self.start, self.step = 0, 1

    def __iter__(self):
        jitter = random.random()  # drawn at each epoch's iter(), in the worker
        for i in range(self.start, self.n, self.step):
            yield {"x": torch.rand(3) + i, "i": i, "jitter": jitter, "np": np.random.rand(),
                   "worker": get_worker_info().id}


class LockedDataset(Dataset):
    """Holds a lock: fork inherits it, but no copy of it can be made."""

    def __init__(self, n=8):
        self.n = n
        self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


class PacedAugmentDataset(InitAugmentDataset):
    """InitAugmentDataset whose every sample takes `sample_s` seconds (set between
    epochs: the next epoch's workers take the value the main process has then)."""

    def __init__(self, n=24, sample_s=0.0):
        super().__init__(n=n)
        self.sample_s = sample_s

    def __getitem__(self, i):
        if self.sample_s:
            time.sleep(self.sample_s)
        return super().__getitem__(i)


class FilePacedAugmentDataset(InitAugmentDataset):
    """InitAugmentDataset whose every sample sleeps the seconds written in `pace_file`,
    read at each sample: the load changes mid-epoch in every worker process at once
    (a value set on the dataset in main reaches only processes started after it)."""

    def __init__(self, pace_file, n=29):
        super().__init__(n=n)
        self.pace_file = str(pace_file)

    def __getitem__(self, i):
        with open(self.pace_file) as f:
            pause = float(f.read() or 0)
        if pause:
            time.sleep(pause)
        return super().__getitem__(i)
