"""Datasets for the stall-report and advice tests; a module of its own so spawn workers
can import them."""
from __future__ import annotations

import time

import torch
import torch.utils.data
from torch.utils.data import Dataset

GATE_TIMEOUT_S = 60.0  # a gate never released still lets the worker go (bounded)


class BlockOnSample(Dataset):
    """Sample i in `gates` blocks in __getitem__ until its gate (a multiprocessing
    Event) is set; every other sample is its index. Sample i in `reached` sets its
    Event as its __getitem__ begins (so main can tell a worker has started)."""

    def __init__(self, gates: dict, n: int = 30, reached: dict | None = None):
        self.gates = gates
        self.n = n
        self.reached = reached or {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.reached:
            self.reached[i].set()
        gate = self.gates.get(i)
        if gate is not None:
            gate.wait(GATE_TIMEOUT_S)  # the blocking line a stall report must show
        return torch.tensor([i])


class BlockingInit:
    """A worker_init_fn that blocks worker 0 until `gate` is set."""

    def __init__(self, gate):
        self.gate = gate

    def __call__(self, worker_id):
        if worker_id == 0:
            self.gate.wait(GATE_TIMEOUT_S)  # the blocking line of the init


class SleepDataset(Dataset):
    """Each sample costs `delay` seconds of sleep (not CPU: the measured shares do not
    depend on how loaded the machine is)."""

    def __init__(self, n: int, delay: float):
        self.n = n
        self.delay = delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return torch.full((4,), i)


class BlockingStream(torch.utils.data.IterableDataset):
    """Yields 0..n-1 in worker 0 only; blocks before item `stuck` until `gate` is set."""

    def __init__(self, gate, n: int = 12, stuck: int = 5):
        self.gate = gate
        self.n = n
        self.stuck = stuck

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id != 0:
            return
        for i in range(self.n):
            if i == self.stuck:
                self.gate.wait(GATE_TIMEOUT_S)  # the blocking line of the stream
            yield torch.tensor([i])
