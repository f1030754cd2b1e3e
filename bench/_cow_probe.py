"""Copy-on-write growth of forked workers: how much of a dataset held in Python
objects each worker copies over one epoch (pytorch/pytorch#13246), with and without
the remedies (`poolloader.frozen`, `gc.freeze()` before the workers fork).

The measurement (`cow_growth`), for bench/memory.py and for this file's own run:
each worker records its pid and its USS (Private_Clean + Private_Dirty of
/proc/<pid>/smaps_rollup: the memory only it maps) in its `worker_init_fn`, before it
reads any sample; main takes every batch of one epoch and, holding the last batch
(the workers are still alive, done with their work), reads each worker's USS again.
Growth = end - start, per worker. A page the worker copies on write counts; a page it
still shares with main or another worker does not.

Data (`coco_records`): a list of `n` dicts shaped like COCO annotations, {"file_name":
str, "id": int, "bbox": [4 floats], "category_id": int, "area": float}; `Annotations`
reads one record per sample, every field of it, and returns 8 float64 values, in the
order the sampler gives (shuffle=True: random access over the whole list).

Run alone (fork, arms DataLoader and PoolLoader, each plain, with `gc.freeze()`, with
`frozen` and with both; every arm runs `--reps` times, in rotated order):
    python bench/_cow_probe.py [--records 500000] [--workers 4] [--reps 1]
                               [--samples N] [--gc-collect]
(`--samples`: an epoch of N random samples; `--gc-collect`: each worker runs one full
collection first, the case `gc.freeze()` is for.)
It prints per arm the median [min-max] of the workers' growth in MiB, and its ratio
to DataLoader's (plain) median growth in the same repetition.
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import procs  # noqa: E402
import workload  # noqa: E402

MIB = 1 << 20


def coco_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` COCO-shaped annotation dicts, the same for the same seed."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        x, y, w, h = (rng.uniform(0, 640) for _ in range(4))
        records.append({"file_name": f"train2017/{rng.randrange(10**12):012d}.jpg", "id": i,
                        "bbox": [x, y, w, h], "category_id": rng.randrange(1, 91), "area": w * h})
    return records


class Annotations:
    """A map-style dataset over `records` (a list of dicts, or poolloader.frozen of one):
    sample i reads every field of record i. `collect_once`: each worker runs one full
    garbage collection (gc.collect()) before its first sample, as some libraries' code
    does."""

    def __init__(self, records: Any, collect_once: bool = False):
        self.records = records
        self.collect_once = collect_once

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        import torch
        if self.collect_once:
            self.collect_once = False  # this worker's copy only
            gc.collect()
        record = self.records[index]
        return torch.tensor([record["id"], record["category_id"], record["area"],
                             *record["bbox"], len(record["file_name"])], dtype=torch.float64)


def _record_start(directory: str, worker_id: int) -> None:
    """worker_init_fn: this worker's pid and USS before it reads any sample."""
    from poolloader.main.memory import read_process

    with open(os.path.join(directory, str(worker_id)), "w") as f:
        f.write(f"{os.getpid()} {read_process(os.getpid())['uss']}")


def _uss(pid: int) -> int:
    """`pid`'s USS (Private_Clean + Private_Dirty), read by poolloader's memory reader."""
    from poolloader.main.memory import read_process

    figures = read_process(pid)
    if figures is None:
        raise SystemExit(f"worker pid {pid} exited before its memory was read")
    return figures["uss"]


def cow_growth(loader_cls: type, dataset: Any, num_workers: int = 4, *, batch_size: int = 256,
               gc_freeze: bool = False, multiprocessing_context: str = "fork", seed: int = 0,
               num_samples: int | None = None, **loader_kwargs: Any) -> dict[str, Any]:
    """One epoch of `loader_cls(dataset, ...)` (shuffled, `num_workers` workers, start
    method `multiprocessing_context`); returns {"start": [bytes], "end": [bytes],
    "growth": [bytes] (one per worker, by worker id), "pids": [int], "epoch_s": float}.

    `num_samples`: an epoch of that many samples drawn at random without replacement
    (default: every sample once).
    `gc_freeze`: call `gc.freeze()` right before the workers start (moving every object
    main holds out of the collector's reach, in main and in the forked workers) and
    `gc.unfreeze()` after the epoch. Workers are shut down before it returns."""
    import torch
    from torch.utils.data import RandomSampler

    generator = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(range(len(dataset)), num_samples=num_samples, generator=generator)
    with tempfile.TemporaryDirectory(prefix="cow-probe-") as directory:
        loader = loader_cls(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                            multiprocessing_context=multiprocessing_context,
                            worker_init_fn=partial(_record_start, directory), **loader_kwargs)
        if gc_freeze:
            gc.collect()
            gc.freeze()
        it = None
        try:
            started = time.perf_counter()
            it = iter(loader)
            batch = None
            for _ in range(len(loader)):
                batch = next(it)  # noqa: F841  (held: the workers stay up until the next call)
            epoch_s = time.perf_counter() - started
            starts = {}
            for worker_id in range(num_workers):
                with open(os.path.join(directory, str(worker_id))) as f:
                    pid, uss = (int(v) for v in f.read().split())
                starts[worker_id] = (pid, uss)
            ends = [_uss(starts[w][0]) for w in range(num_workers)]
        finally:
            if it is not None:
                workload.shutdown_iterator(it)
            del it
            if gc_freeze:
                gc.unfreeze()
    start = [starts[w][1] for w in range(num_workers)]
    return {"start": start, "end": ends, "growth": [e - s for e, s in zip(ends, start)],
            "pids": [starts[w][0] for w in range(num_workers)], "epoch_s": epoch_s}


def arms() -> list[tuple[str, type, bool, bool]]:
    """(label, loader class, frozen records, gc.freeze) of every arm this file runs."""
    from torch.utils.data import DataLoader

    from poolloader import PoolLoader
    return [(f"{name}{suffix}", cls, frozen, freeze)
            for name, cls in (("DataLoader", DataLoader), ("PoolLoader", PoolLoader))
            for suffix, frozen, freeze in (("", False, False), (" + gc.freeze()", False, True),
                                           (" + frozen", True, False),
                                           (" + frozen + gc.freeze()", True, True))]


def main(argv: list[str] | None = None) -> None:
    import poolloader

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per epoch, drawn at random (default: every record once)")
    parser.add_argument("--gc-collect", action="store_true",
                        help="each worker runs gc.collect() once, before its first sample")
    args = parser.parse_args(argv)

    def dataset(use_frozen: bool) -> Annotations:
        """The records built anew for each arm: a frozen arm's workers inherit no list of
        dicts (a full collection in a worker would write the headers of every object
        main still holds), as where the user keeps only the frozen container."""
        records = coco_records(args.records)
        return Annotations(poolloader.frozen(records) if use_frozen else records, args.gc_collect)

    before = procs.rss_bytes()
    sizes = [len(pickle.dumps(r, pickle.HIGHEST_PROTOCOL)) for r in coco_records(1000)]
    print(f"{args.records} records (~{statistics.mean(sizes):.0f} B pickled each); "
          f"RSS before building any: {before / MIB:.0f} MiB; fork, "
          f"{args.workers} workers, batch {args.batch_size}, "
          f"{args.samples or args.records} samples per epoch"
          f"{', gc.collect() once per worker' if args.gc_collect else ''}")
    table = arms()
    medians: dict[str, list[float]] = {label: [] for label, *_ in table}
    ranges: dict[str, list[int]] = {label: [] for label, *_ in table}
    ratios: dict[str, list[float]] = {label: [] for label, *_ in table}
    for rep in range(args.reps):
        shift = rep % len(table)
        for label, cls, use_frozen, freeze in table[shift:] + table[:shift]:
            data = dataset(use_frozen)
            result = cow_growth(cls, data, args.workers, batch_size=args.batch_size, gc_freeze=freeze,
                                num_samples=args.samples)
            del data
            gc.collect()
            medians[label].append(statistics.median(result["growth"]))
            ranges[label] += result["growth"]
            print(f"  rep {rep} {label}: growth per worker "
                  f"{[round(g / MIB, 1) for g in result['growth']]} MiB, epoch {result['epoch_s']:.1f} s",
                  flush=True)
        for label in medians:
            ratios[label].append(medians[label][-1] / max(1.0, medians["DataLoader"][-1]))
    print("\n| arm | USS growth per worker, MiB: median [min-max] | ÷ DataLoader's |")
    print("|---|---|---|")
    for label in medians:
        grow = ranges[label]
        print(f"| {label} | {statistics.median(grow) / MIB:.1f} [{min(grow) / MIB:.1f}-"
              f"{max(grow) / MIB:.1f}] | {statistics.median(ratios[label]):.3f} |")


if __name__ == "__main__":
    main()
