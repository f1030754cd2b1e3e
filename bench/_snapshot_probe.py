"""What a worker's resume record costs when the dataset is an nn.Module.

A dataset that is also a ``torch.nn.Module`` has a ``state_dict()``: its parameters
and buffers (here one 4 MiB buffer). With ``stateful=True`` a worker takes it only
with snapshot batches (``snapshot_every_n_steps``; for an nn.Module the default is
every 64 steps, see poolloader.resume.keys), so the loader should run near
``stateful=False``'s rate. Arms, in one run, on the same dataset, interleaved (the
order rotated per repetition): torch's DataLoader; PoolLoader with stateful=True at
the default; PoolLoader with stateful=False; and, for contrast, PoolLoader with
snapshot_every_n_steps=1 (every batch carries the 4 MiB state, the behaviour before
snapshots). Each repetition builds the loader, takes the first batch (start-up is
not timed), then times the rest of the epoch; reported: batches/s, median
[min–max] over repetitions, and the ratio of medians to DataLoader's.

``module_dataset_rates()`` returns the figures as a dict (bench/memory.py may import
it); run as a script it prints a Markdown table::

    python bench/_snapshot_probe.py [--workers 4] [--batches 200] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from poolloader import PoolLoader  # noqa: E402

BUFFER_BYTES = 4 << 20
ARMS = ("DataLoader", "PoolLoader stateful=True (default)", "PoolLoader stateful=False",
        "PoolLoader snapshot_every_n_steps=1")


class ModuleDataset(torch.nn.Module, torch.utils.data.Dataset):
    """An nn.Module dataset (e.g. one holding a normalisation or augmentation
    network): a `buffer_bytes` buffer, samples of 3×64×64 float32 drawn per item."""

    def __init__(self, n: int, buffer_bytes: int = BUFFER_BYTES):
        torch.nn.Module.__init__(self)
        self.n = n
        self.register_buffer("table", torch.rand(buffer_bytes // 4))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.rand(3, 64, 64) + self.table[i % self.table.numel()], i


def _loader(arm: str, dataset, num_workers: int, batch_size: int):
    common = dict(batch_size=batch_size, num_workers=num_workers, shuffle=True)
    if arm == "DataLoader":
        return torch.utils.data.DataLoader(dataset, **common)
    if arm == "PoolLoader stateful=False":
        return PoolLoader(dataset, stateful=False, **common)
    if arm == "PoolLoader snapshot_every_n_steps=1":
        return PoolLoader(dataset, snapshot_every_n_steps=1, **common)
    return PoolLoader(dataset, **common)


def _rate(arm: str, dataset, num_workers: int, batch_size: int) -> float:
    loader = _loader(arm, dataset, num_workers, batch_size)
    it = iter(loader)
    next(it)  # start-up is not what is measured
    count, start = 0, time.perf_counter()
    for _batch in it:
        count += 1
    rate = count / (time.perf_counter() - start)
    del it
    return rate


def module_dataset_rates(num_workers: int = 4, batches: int = 200, reps: int = 5,
                         batch_size: int = 16, buffer_bytes: int = BUFFER_BYTES) -> dict:
    """{arm: {"median", "min", "max", "n", "ratio"}} in batches/s for the ARMS, measured
    in this process, interleaved; "ratio" is the arm's median over DataLoader's."""
    dataset = ModuleDataset((batches + 1) * batch_size, buffer_bytes)
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with warnings.catch_warnings():
        # torch's "more workers than cores", and the large-record warning (4 MiB > 1 MiB)
        warnings.simplefilter("ignore", UserWarning)
        for rep in range(reps):
            order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
            for arm in order:
                rates[arm].append(_rate(arm, dataset, num_workers, batch_size))
    base = statistics.median(rates["DataLoader"])
    out = {}
    for arm, values in rates.items():
        median = statistics.median(values)
        out[arm] = {"median": median, "min": min(values), "max": max(values), "n": len(values),
                    "ratio": median / base}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    rates = module_dataset_rates(args.workers, args.batches, args.reps, args.batch_size)
    print(f"nn.Module dataset, {BUFFER_BYTES >> 20} MiB buffer, {args.workers} workers, "
          f"batch {args.batch_size}, {args.batches} batches timed, {args.reps} reps")
    print("| loader | batches/s median [min–max] | × DataLoader |")
    print("|---|---|---|")
    for arm, r in rates.items():
        print(f"| {arm} | {r['median']:.1f} [{r['min']:.1f}–{r['max']:.1f}] | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
