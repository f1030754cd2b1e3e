"""Probe: memory and time to the first batch when the dataset holds large arrays,
torch DataLoader vs PoolLoader (and PoolLoader at a baseline tree), under forkserver.

Dataset (`BigArrays`): a `--array-mib` MiB float32 numpy array and a `--tensor-mib`
MiB float32 CPU tensor; item i reads a 1 MiB block of each (block (i // workers) %
16 of 16, so each worker reads every block over an epoch: every page once) and
returns their sums. Per arm (DataLoader, PoolLoader, PoolLoader at `--baseline`),
in a fresh process each (so no arm sees another's pages): `--workers` workers,
persistent, batch_size=1, forkserver (its server started before timing);
  first  seconds from iter(loader) to the first batch in hand;
  pss    sum over the workers of /proc/<pid>/smaps_rollup's Pss after one epoch
         (a shared page counts 1/n in each of its n mappers);
  rss    the same sum of Rss.
Arms run back to back in rotated order per repetition; medians [min–max] and the
ratios to DataLoader, paired per repetition. A probe for bench/memory.py, not a
benchmark of its own (no bench/common.py outputs).

Usage:
    python bench/_arrays_probe.py [--array-mib 512] [--tensor-mib 256] [--workers 4]
        [--reps 3] [--baseline PATH_TO_A_TREE_WITH_poolloader/]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BLOCKS = 16


def workers_pss(pids) -> tuple[int, int]:
    """(sum of Pss, sum of Rss) in bytes over `pids`, from /proc/<pid>/smaps_rollup."""
    pss = rss = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "Pss":
                    pss += int(rest.split()[0]) * 1024
                elif key == "Rss":
                    rss += int(rest.split()[0]) * 1024
    return pss, rss


class BigArrays:
    """A numpy array and a CPU tensor (module docstring); map-style."""

    def __init__(self, array_mib: int, tensor_mib: int, workers: int):
        import numpy as np
        import torch
        self.array = np.ones(array_mib << 18, dtype=np.float32)
        self.tensor = torch.ones(tensor_mib << 18, dtype=torch.float32)
        self.workers = workers

    def __len__(self):
        return BLOCKS * self.workers

    def __getitem__(self, i):
        block = (i // self.workers) % BLOCKS
        a, t = len(self.array) // BLOCKS, len(self.tensor) // BLOCKS
        return (float(self.array[block * a:(block + 1) * a].sum()),
                float(self.tensor[block * t:(block + 1) * t].sum()))


def child(arm: str, array_mib: int, tensor_mib: int, workers: int) -> dict:
    import multiprocessing

    from torch.utils.data import DataLoader

    from poolloader import PoolLoader
    ctx = multiprocessing.get_context("forkserver")
    list(DataLoader(range(2), num_workers=1, multiprocessing_context=ctx))  # the server is up
    data = BigArrays(array_mib, tensor_mib, workers)
    cls = DataLoader if arm == "DataLoader" else PoolLoader
    loader = cls(data, batch_size=1, num_workers=workers, persistent_workers=True,
                 multiprocessing_context=ctx)
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    n = 1 + sum(1 for _ in it)
    assert n == len(data), n
    pss, rss = workers_pss([w.pid for w in loader._iterator._workers])
    loader._iterator._shutdown_workers()
    return {"first": first, "pss": pss, "rss": rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--array-mib", type=int, default=512)
    p.add_argument("--tensor-mib", type=int, default=256)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--baseline", help="a tree whose poolloader/ is the baseline PoolLoader")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.array_mib, args.tensor_mib, args.workers)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    arms = {"DataLoader": here, "PoolLoader": here}
    if args.baseline:
        arms["PoolLoader (baseline)"] = os.path.abspath(args.baseline)
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    names = list(arms)
    for rep in range(args.reps):
        for arm in names[rep % len(names):] + names[:rep % len(names)]:
            env = dict(os.environ, PYTHONPATH=arms[arm])
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", arm.split()[0],
                 "--array-mib", str(args.array_mib), "--tensor-mib", str(args.tensor_mib),
                 "--workers", str(args.workers)],
                env=env, capture_output=True, text=True, timeout=600, check=True)
            results[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rep, arm, results[arm][-1], flush=True)

    def fmt(values, unit=1.0, digits=2):
        v = [x / unit for x in values]
        return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}–{max(v):.{digits}f}]"

    print(f"\n{args.workers} workers, forkserver, {args.array_mib} MiB numpy + {args.tensor_mib} MiB tensor, "
          f"{args.reps} reps")
    print("| arm | first batch s | workers' PSS MiB | workers' RSS MiB | PSS ÷ DataLoader's "
          "| first ÷ DataLoader's |")
    print("|---|---|---|---|---|---|")
    base = results["DataLoader"]
    for arm, rows in results.items():
        print(f"| {arm} | {fmt([r['first'] for r in rows])} | {fmt([r['pss'] for r in rows], 1 << 20, 0)} | "
              f"{fmt([r['rss'] for r in rows], 1 << 20, 0)} | "
              f"{fmt([r['pss'] / b['pss'] for r, b in zip(rows, base)])} | "
              f"{fmt([r['first'] / b['first'] for r, b in zip(rows, base)])} |")
    if args.baseline:
        old = results["PoolLoader (baseline)"]
        print("PoolLoader first ÷ baseline's: "
              f"{fmt([r['first'] / b['first'] for r, b in zip(results['PoolLoader'], old)])}; "
              f"PSS ÷ baseline's: {fmt([r['pss'] / b['pss'] for r, b in zip(results['PoolLoader'], old)])}")


if __name__ == "__main__":
    main()
