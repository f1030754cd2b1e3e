"""Datasets and collates for loader tests; a module of its own so spawn workers can import them."""
from __future__ import annotations

import collections
import dataclasses
import os
import random
import time

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Meta:
    name: str
    weight: float


class AugmentDataset(Dataset):
    """Every sample draws from torch, numpy and random: parity proves seeding and assignment."""

    def __init__(self, n=37, shape=(3, 5, 7)):
        self.n = n
        self.shape = shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return {
            "image": torch.rand(self.shape) + i,
            "np": np.random.rand(2).astype(np.float32),
            "py": random.random(),
            "index": i,
            "worker": -1 if info is None else info.id,
            "name": f"sample-{i}",
        }


class SlowAugmentDataset(Dataset):
    """AugmentDataset's draws in a tensor big enough to stay in its slot (256 KiB: a
    view, not copied into the small block), after a sleep of `delay` seconds plus up to
    `jitter` (fixed per index): the workers are the bottleneck, by as much as chosen."""

    def __init__(self, n=48, delay=0.0, jitter=0.0, numel=1 << 16):
        self.n, self.delay, self.jitter, self.numel = n, delay, jitter, numel

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay + self.jitter * (i * 2654435761 % 1000) / 1000)
        info = get_worker_info()
        return {
            "image": torch.rand(self.numel) + i,
            "np": np.random.rand(2).astype(np.float32),
            "py": random.random(),
            "index": i,
            "worker": -1 if info is None else info.id,
        }


class GrowingDataset(Dataset):
    """Sample i: `delay` seconds, then 128 KiB × 1.02**i filled with i: every few samples
    a batch outgrows its slot, so main replaces slots while requests move."""

    def __init__(self, n=300, delay=0.004):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.full((int((1 << 15) * 1.02 ** i),), float(i))


class VariedDataset(Dataset):
    """Structures of every kind a collate_fn may return, at odd sizes."""

    def __init__(self, n=23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        k = i % 4
        return {
            "f16": torch.randn(k, 3, generator=g).half(),
            "bf16": torch.randn(2, generator=g).bfloat16(),
            "i8": torch.randint(-5, 5, (k,), generator=g, dtype=torch.int8),
            "bool": torch.rand(5, generator=g) > 0.5,
            "c64": torch.randn(3, dtype=torch.complex64, generator=g),
            "zero_dim": torch.tensor(i),
            "empty": torch.empty(0, 4),
            "transposed": torch.arange(12.0).reshape(3, 4).t() + i,
            "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
            "np_f": np.arange(i, i + 6, dtype=np.float64).reshape(2, 3),
            "np_fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
            "bytes": bytes([i % 256]) * 3,
            "none": None,
            "pair": Pair(torch.tensor([i]), f"r{i}"),
            "meta": Meta(f"m{i}", i / 3),
            "sparse": torch.sparse_coo_tensor([[0, 1]], [float(i), 2.0], (3,)),
            "nested": [[i, {"deep": torch.ones(2) * i}], (i,)],
        }


def list_collate(batch):
    """A user collate that keeps samples apart (no stacking)."""
    return list(batch)


def numpy_collate(batch):
    return np.stack([b["image"].numpy() for b in batch]), [b["index"] for b in batch]


class SeedInfoDataset(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        info = get_worker_info()
        return torch.tensor([i, info.id, info.num_workers, info.seed % 1000003,
                             torch.initial_seed() % 1000003])


class ParentProcessDataset(AugmentDataset):
    """AugmentDataset's samples plus what multiprocessing.parent_process() says in the
    worker: alive, its pid and name, whether join(0.05) waited as for a live parent,
    whether its sentinel reads as ready."""

    def __getitem__(self, i):
        import multiprocessing
        import multiprocessing.connection

        parent = multiprocessing.parent_process()
        t0 = time.monotonic()
        parent.join(0.05)
        waited = time.monotonic() - t0
        ready = bool(multiprocessing.connection.wait([parent.sentinel], timeout=0))
        return {**super().__getitem__(i), "alive": parent.is_alive(), "parent_pid": parent.pid,
                "parent_name": parent.name, "join_waited": 0.04 <= waited < 5.0,
                "sentinel_ready": ready}


class SegfaultDataset(Dataset):
    """Every sample crashes its worker with SIGSEGV (a read at address 0)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import ctypes
        return ctypes.string_at(0)


def quiet_stderr(worker_id):
    """worker_init_fn: the worker's stderr goes to /dev/null (torch's SIGSEGV handler
    writes there with write(2))."""
    import sys
    sys.stderr.flush()
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)


def record_init(worker_id):
    torch.manual_seed(1000 + worker_id)


class FailingDataset(Dataset):
    def __init__(self, bad=5, exc=KeyError):
        self.bad = bad
        self.exc = exc

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == self.bad:
            raise self.exc(f"bad sample {i}")
        return torch.full((4,), i)


def failing_collate(batch):
    raise ValueError("collate exploded")


def failing_init(worker_id):
    raise OSError(f"init of worker {worker_id} failed")


class SlowDataset(Dataset):
    def __init__(self, n=8, delay=0.5):
        self.n = n
        self.delay = delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.tensor(i)


class PidDataset(Dataset):
    """Returns the pid of the worker, for tests that kill it."""

    def __init__(self, n=400, delay=0.02):
        self.n = n
        self.delay = delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.tensor([i, os.getpid()])


class BigDataset(Dataset):
    """Samples whose size varies a lot: exercises slot growth."""

    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        side = 16 + (i * 37) % 200
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, side, side, generator=g), i


def pad_collate(batch):
    side = max(b[0].shape[-1] for b in batch)
    out = torch.zeros(len(batch), 3, side, side)
    for k, (img, _i) in enumerate(batch):
        out[k, :, : img.shape[1], : img.shape[2]] = img
    return out, torch.tensor([b[1] for b in batch])


def rfdetr_like(i, hw=576):
    g = torch.Generator().manual_seed(i)
    n = (i * 5) % 13
    return (
        torch.rand(3, hw, hw, generator=g),
        torch.rand(hw, hw, generator=g) > 0.9,
        {
            "boxes": torch.rand(n, 4, generator=g),
            "labels": torch.randint(0, 90, (n,), generator=g),
            "image_id": torch.tensor([i]),
            "area": torch.rand(n, generator=g),
            "iscrowd": torch.zeros(n, dtype=torch.int64),
            "orig_size": torch.tensor([480, 640]),
            "size": torch.tensor([hw, hw]),
        },
    )


class RFDETRShaped(Dataset):
    def __init__(self, n=64, hw=576):
        self.n = n
        self.hw = hw

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return rfdetr_like(i, self.hw)


def rfdetr_collate(batch):
    images = torch.stack([b[0] for b in batch])
    masks = torch.stack([b[1] for b in batch])
    return images, masks, tuple(b[2] for b in batch)


def _graph_probe():
    x = torch.ones(1, requires_grad=True)
    return GraphProbe((x * 2).grad_fn is not None)


class GraphProbe:
    """Records, as it is unpickled, whether autograd recorded an op made then: a batch
    object whose reduce function computes with tensors."""

    def __init__(self, recorded=None):
        self.recorded = recorded

    def __reduce__(self):
        return (_graph_probe, ())


def probed_collate(batch):
    """rfdetr_collate's batch with a GraphProbe beside it."""
    return (*rfdetr_collate(batch), GraphProbe())


def repeating_collate(batch):
    """rfdetr_collate's batch holding its images and one target's labels twice each."""
    images, masks, targets = rfdetr_collate(batch)
    return {"images": images, "again": images, "labels": targets[0]["labels"],
            "targets": targets, "masks": masks}


KEPT = []


def keeping_collate(batch):
    """A collate that keeps what it returns (a bug the worker must warn about)."""
    from poolloader import slot_collate
    out = slot_collate(batch)
    KEPT.append(out)
    return out


class ListDataset(Dataset):
    """Serves given items, each after `delay` seconds (so a reader can be made late)."""

    def __init__(self, items, delay=0.0):
        self.items = items
        self.delay = delay

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.items[i]
