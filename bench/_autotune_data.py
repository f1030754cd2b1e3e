"""The dataset of bench/autotune.py, in a module of its own so that forkserver workers
unpickle it by name (the bench runs as __main__)."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Crunch(Dataset):
    """Item i: a 64-vector after `rounds` rounds of a 256×256 matrix product (CPU work in
    __getitem__, no sleep: it competes for cores as an augmentation pipeline does);
    rounds=0 is instant."""

    def __init__(self, length: int, rounds: int):
        self.length, self.rounds = length, rounds

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.rand(256, 256, generator=g)
        for _ in range(self.rounds):
            x = torch.tanh(x @ x * (1 / 256))
        return x[0, :64].clone()
