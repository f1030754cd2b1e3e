"""The dataset of bench/autotune.py, in a module of its own so that forkserver workers
unpickle it by name (the bench runs as __main__)."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Crunch(Dataset):
    """Item i: a 64-vector after `rounds` rounds of a 256×256 matrix product (CPU work in
    __getitem__, no sleep: it competes for cores as an augmentation pipeline does);
    rounds=0 is instant. `rounds_file`: the rounds are read from it at every sample
    instead (the load changes mid-epoch in every worker process at once)."""

    def __init__(self, length: int, rounds: int, rounds_file: str | None = None):
        self.length, self.rounds, self.rounds_file = length, rounds, rounds_file

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        rounds = self.rounds
        if self.rounds_file is not None:
            with open(self.rounds_file) as f:
                rounds = int(f.read())
        g = torch.Generator().manual_seed(i)
        x = torch.rand(256, 256, generator=g)
        for _ in range(rounds):
            x = torch.tanh(x @ x * (1 / 256))
        return x[0, :64].clone()
