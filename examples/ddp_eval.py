"""DDP training with evaluation on rank 0 only: the script shape most DDP code has.

    torchrun --standalone --nproc_per_node=2 examples/ddp_eval.py --out run.json
    torchrun --standalone --nproc_per_node=2 -m poolloader --node-pool examples/ddp_eval.py --out run.json

Every rank builds the train loader (a DistributedSampler gives each its share); rank 0
alone builds an evaluation loader before the train loader (`--eval-first`) and after
every epoch. Under `-m poolloader --node-pool` every `DataLoader(num_workers > 0)` the
script builds is a node-pool PoolLoader: the train loaders, built at the same place on
every rank, share one set of worker processes; each evaluation loader, built on rank 0
only, is rank 0's own loader (with the node's whole prefetch depth once nobody joined
it for 5 s: docs/node.md), and dropping it waits for nobody. Nothing in the script
knows which loader it runs.

Each rank writes its own JSON (`--out` with `.rank<R>` before the extension): its loss
at every step, rank 0's evaluation losses, and how long each evaluation loader took to
drop (`del` of its last reference). The data is generated in code: small images whose
label is the brighter half, with a random flip drawn in the workers (each worker's
torch seed, as DataLoader sets it), so the batches depend on DataLoader's seeding.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Halves(Dataset):
    """`n` 1×16×16 images; label 1 where the left half is brighter; flipped at random."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 1, 16, 16, generator=g)
        self.labels = (self.images[..., :8].mean((1, 2, 3)) > self.images[..., 8:].mean((1, 2, 3)))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image, label = self.images[i], int(self.labels[i])
        if torch.rand(()) < 0.5:  # the worker's RNG: the batch depends on its seeding
            image, label = image.flip(-1), 1 - label
        return image, label


def evaluate(model: torch.nn.Module, data: Dataset, workers: int) -> tuple[float, float]:
    """(mean loss, seconds the loader took to drop) over `data`, rank 0's alone."""
    loader = DataLoader(data, batch_size=16, num_workers=workers,
                        generator=torch.Generator().manual_seed(1))
    total, n = 0.0, 0
    with torch.no_grad():
        for images, labels in loader:
            total += torch.nn.functional.cross_entropy(model(images), labels, reduction="sum").item()
            n += len(labels)
    started = time.monotonic()
    del loader
    gc.collect()
    return total / n, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--eval-first", action="store_true", help="rank 0 evaluates before training")
    p.add_argument("--out", required=True, help="JSON path (.rank<R> before the extension)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    evaluations, drops = [], []
    held_out = Halves(96, seed=2)
    if rank == 0 and args.eval_first:
        loss, drop = evaluate(model, held_out, args.workers)
        evaluations.append(loss)
        drops.append(drop)
    train = Halves(256, seed=1)
    sampler = DistributedSampler(train, shuffle=True, seed=3)
    loader = DataLoader(train, batch_size=16, sampler=sampler, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(4 + rank))
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(ddp(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if rank == 0:
            loss, drop = evaluate(model, held_out, args.workers)
            evaluations.append(loss)
            drops.append(drop)
        dist.barrier()
    stem, ext = os.path.splitext(args.out)
    with open(f"{stem}.rank{rank}{ext}", "w") as f:
        # the report only: which side of a node pool this rank's train loader was
        json.dump({"rank": rank, "loader": type(loader).__name__, "losses": losses,
                   "node": type(getattr(loader, "_node", None)).__name__,
                   "evaluations": evaluations, "drop_s": drops}, f)
    del loader
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
