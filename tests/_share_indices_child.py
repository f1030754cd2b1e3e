"""One rank of test_share_indices.py: `python _share_indices_child.py CASE OUT_DIR ARG`,
started as test_node_pool's `_ranks` starts tests/_node_children.py (whose helpers it
uses: `meet`, `same`, `backing_inode`, the worker_init_fn). Ranks 0 and 1 are one
data-parallel rank, `share_batches=[0, 1]`; each batch sampler yields a batch's indices
as an int64 tensor (ARG "tensor") or a numpy array (ARG "numpy"), not a list.

Cases:
  indices  two epochs of DataLoader, then of PoolLoader(share_batches): records whether
        they are equal, the rank's role and the memfd inode behind each batch.
  indices_mismatch  rank 1's batch sampler has another seed: records the error.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader, Sampler

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _node_children import (  # noqa: E402  (reads CASE, OUT, ARG from sys.argv as this does)
    ARG,
    CASE,
    RANK,
    WORKERS,
    Augmented,
    backing_inode,
    init_fn,
    meet,
    run_rank,
    same,
)

from poolloader import PoolLoader  # noqa: E402

SHARE_GROUP = [0, 1]
N_SAMPLES, BATCH = 46, 4  # the last batch has 2


class IndexBatches(Sampler):
    """A shuffled epoch in batches, each an int64 tensor or numpy array of indices."""

    def __init__(self, n: int, batch_size: int, kind: str, seed: int):
        self.n, self.batch_size, self.kind, self.seed, self.epoch = n, batch_size, kind, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for start in range(0, self.n, self.batch_size):
            batch = order[start:start + self.batch_size]
            yield batch if self.kind == "tensor" else batch.numpy()


class Indexed(Augmented):
    """Augmented, indexed by whatever the batch holds (a 0-d tensor, a numpy int), with a
    tensor too big for the small block, so it views the slot itself."""

    def __getitem__(self, i):
        return (*super().__getitem__(int(i)), torch.rand(128, 128))


def build(cls, seed=5, **kw):
    sampler = IndexBatches(N_SAMPLES, BATCH, ARG, seed)
    return cls(Indexed(N_SAMPLES), batch_sampler=sampler, num_workers=WORKERS,
               worker_init_fn=init_fn, generator=torch.Generator().manual_seed(11), **kw), sampler


def epochs(made, look=None) -> list:
    it_loader, sampler = made
    out = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = []
        for batch in it_loader:
            if look is not None and epoch == 0:
                look(batch)
            batches.append([t.clone() for t in batch])
        out.append(batches)
    return out


def main() -> dict:
    if CASE == "indices":
        expected = epochs(build(DataLoader))
        pool = build(PoolLoader, share_batches=SHARE_GROUP)
        inodes: list = []
        got = epochs(pool, look=lambda batch: inodes.append(backing_inode(batch[2])))
        result = {"equal": same(expected, got), "batches": len(got[0]), "inodes": inodes,
                  "role": getattr(pool[0]._share, "role", None)}
        meet("done")
        return result
    if CASE == "indices_mismatch":
        pool, _ = build(PoolLoader, seed=6 if RANK == 1 else 5, share_batches=SHARE_GROUP)
        error = None
        try:
            for _ in pool:
                pass
        except Exception as e:  # noqa: BLE001 -- the error is what the test reads
            error = f"{type(e).__name__}: {e}"
        result = {"error": error, "role": getattr(pool._share, "role", None)}
        meet("done")
        return result
    raise ValueError(f"unknown case {CASE!r}")


if __name__ == "__main__":
    run_rank(main)
