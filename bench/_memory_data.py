"""The datasets of bench/memory.py, in a module of their own so that spawn and
forkserver workers unpickle them by name (the bench's children run it as __main__)."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

MIB = 1 << 20


class Arrays(Dataset):
    """A numpy array and a tensor, item i a row of each at a random place."""

    def __init__(self, array_mib: int, tensor_mib: int, length: int):
        row = 4096  # float32 columns: 16 KiB a row
        self.array = np.ones((max(1, array_mib * MIB // (4 * row)), row), np.float32)
        self.tensor = torch.ones((max(1, tensor_mib * MIB // (4 * row)), row))
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        j = (i * 2654435761) % len(self.array)
        k = (i * 40503) % len(self.tensor)
        return torch.from_numpy(self.array[j].copy()) + self.tensor[k]


class Records(Dataset):
    """A list of COCO-ish dicts (or whatever holds them), item i a small tensor."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = self.items[i]
        return torch.tensor([d["id"], d["category_id"], d["area"], len(d["file_name"])])


class ModuleDataset(torch.nn.Module, Dataset):
    """A dataset that is an nn.Module with a buffer (a learned augmentation's)."""

    def __init__(self, buffer_mib: int, length: int):
        torch.nn.Module.__init__(self)
        self.register_buffer("table", torch.arange(buffer_mib * MIB // 4, dtype=torch.float32))
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        j = (i * 2654435761) % (len(self.table) - 64)
        return self.table[j:j + 64] * 2
