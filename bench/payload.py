"""Batch size in bytes, 1 MiB to 256 MiB: torch DataLoader vs PoolLoader.

Data: each sample is one float32 tensor of `batch bytes / 16` bytes (made once
per worker process, returned as is) plus its index; `default_collate` stacks 16
of them, so every batch is two tensors: [16, n] float32 and [16] int64. The
worker work is exactly one copy of the payload (the stack): DataLoader's
default_collate stacks into a fresh shared-memory segment, PoolLoader's into
its slot. What differs is everything around that copy: segment creation and
page faults per batch (DataLoader) vs a reused slot (PoolLoader), and the
hand-off to the main process.

Arms: `DataLoader` and `PoolLoader` with the same arguments (batch 16,
`--workers` workers, default 2; prefetch_factor 2; default sharing strategy;
PoolLoader at its default 1 MiB initial slots, grown in the warm-up).

Method, per cell (payload size × arm), via bench/common.py's `interleave` and
bench/workload.py's `measure_loader`: create the loader,
draw `workers × 2 + 4` warm-up batches untimed, then the timed ones (about
`--mib-per-cell` of payload: at least `--batches`, at most 400 batches), each `next()`
then `del`, nothing else (the data set holds more batches than
are drawn, so the pipeline never drains). Reported:
  main ms/batch  the main thread's CPU time over `next()` + `del` per batch
                 (`time.thread_time`, median over the timed batches): what
                 receiving and releasing a batch costs the training process,
                 time blocked waiting for a worker excluded;
  GiB/s          payload bytes delivered per second of wall time (the loader's
                 own throughput: the consumer does nothing);
  CPU ms/batch   CPU time of main process + workers (all threads, /proc
                 schedstat) over the timed window, per batch: what the whole
                 hand-off costs the machine, the stack copy included.
Repetitions interleave the arms in rotated order; medians [min–max] over
repetitions and paired PoolLoader / DataLoader ratios per repetition. Pool
memory at 256 MiB: (workers × 2 + 2) slots × 320 MiB in /dev/shm.

Usage:
    python bench/payload.py [--quick] [--sizes-mib 1,4,16,64,256] [--workers 2]
                            [--out results/] [--json P] [--markdown P] [--plot P]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import procs  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402
import writers  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from poolloader import PoolLoader  # noqa: E402

NAME = "payload"
BATCH = 16
PREFETCH = 2
ARMS = ("DataLoader", "PoolLoader")
LOADERS = {"DataLoader": DataLoader, "PoolLoader": PoolLoader}
MAX_BATCHES = 400
METRICS = ("main_cpu_ms", "gib_s", "total_cpu_ms", "worker_cpu_ms", "main_proc_cpu_ms",
           "next_ms", "del_ms", "batch_s")


class PayloadDataset(Dataset):
    """`length` samples of (float32 tensor of `sample_bytes`, int64 index).

    The tensor is built once per process (lazily, so nothing big is pickled
    to spawned workers) and returned as is: collate's copy is the only work.
    """

    def __init__(self, length: int, sample_bytes: int):
        self.length = length
        self.numel = max(1, sample_bytes // 4)
        self._base = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if self._base is None:
            self._base = torch.arange(self.numel, dtype=torch.float32)
        return self._base, index

    def __getstate__(self):
        return {"length": self.length, "numel": self.numel, "_base": None}


def measure(mib, arm, args) -> dict:
    warmup = args.workers * PREFETCH + 4
    batches = timed_batches(mib, args)
    extra = args.workers * PREFETCH + 2
    dataset = PayloadDataset(BATCH * (warmup + batches + extra), int(mib * 2**20) // BATCH)
    loader = LOADERS[arm](dataset, batch_size=BATCH, shuffle=False, num_workers=args.workers,
                          prefetch_factor=PREFETCH)
    try:
        out = workload.measure_loader(loader, warmup, batches, BATCH)
    finally:
        del loader
        left = procs.wait_clean()
        if left:
            raise RuntimeError(f"left behind after the cell: {left}")
    out["gib_s"] = out["batch_s"] * mib / 1024
    return out


def timed_batches(mib, args) -> int:
    """Enough batches for about `--mib-per-cell` of payload, within [--batches, MAX]."""
    return max(args.batches, min(MAX_BATCHES, int(args.mib_per_cell / mib)))


def render(raw, args) -> str:
    rows = []
    for mib in raw.cells:
        rows.append([
            f"{mib:g} MiB", timed_batches(mib, args),
            common.cell_text(raw, mib, "DataLoader", "main_cpu_ms", ".3f"),
            common.cell_text(raw, mib, "PoolLoader", "main_cpu_ms", ".3f"),
            common.ratio_text(raw, mib, "PoolLoader", "DataLoader", "main_cpu_ms", ".3f"),
            common.cell_text(raw, mib, "DataLoader", "gib_s", ".2f"),
            common.cell_text(raw, mib, "PoolLoader", "gib_s", ".2f"),
            common.ratio_text(raw, mib, "PoolLoader", "DataLoader", "gib_s"),
            common.cell_text(raw, mib, "DataLoader", "total_cpu_ms", ".2f"),
            common.cell_text(raw, mib, "PoolLoader", "total_cpu_ms", ".2f"),
            common.ratio_text(raw, mib, "PoolLoader", "DataLoader", "total_cpu_ms"),
        ])
    head = (f"Payload sweep: batch {BATCH} samples = 2 tensors, {args.workers} workers, "
            f"timed batches per cell after warm-up as listed, {args.reps} repetitions "
            f"(+{args.warmup_reps} warm-up), median [min–max]; ratios paired per repetition. "
            f"main ms = main-thread CPU time of next() + del. {writers.env_line()}.")
    table = writers.markdown_table(
        ["batch bytes", "timed batches", "DataLoader main ms", "PoolLoader main ms",
         "Pool/DL main ms", "DataLoader GiB/s", "PoolLoader GiB/s", "Pool/DL GiB/s",
         "DataLoader CPU ms/batch", "PoolLoader CPU ms/batch", "Pool/DL CPU"], rows)
    return f"### {NAME}\n\n{head}\n\n{table}\n"


def plot(raw, args):
    xs = list(raw.cells)
    return writers.plot_sweep(
        args.plot, xs, {arm: [common.summarize(raw.series(m, arm, "main_cpu_ms")) for m in xs]
                        for arm in ARMS},
        xlabel="batch payload (MiB)", ylabel="main-process CPU ms per batch (next + del)",
        title=f"payload sweep, {args.workers} workers, batch {BATCH}",
        ratios={"PoolLoader / DataLoader main ms":
                [common.ratio(raw, m, "PoolLoader", "DataLoader", "main_cpu_ms") for m in xs],
                "PoolLoader / DataLoader GiB/s":
                [common.ratio(raw, m, "PoolLoader", "DataLoader", "gib_s") for m in xs],
                "PoolLoader / DataLoader CPU ms (main + workers)":
                [common.ratio(raw, m, "PoolLoader", "DataLoader", "total_cpu_ms") for m in xs]},
        logx=True, logy=True)


def main(argv=None) -> None:
    p = common.parser(NAME, __doc__)
    p.add_argument("--sizes-mib", default="1,4,16,64,256", help="comma-separated batch sizes in MiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=None,
                   help="minimum timed batches per cell (30; quick 12)")
    p.add_argument("--mib-per-cell", type=float, default=None,
                   help=f"payload timed per cell, at most {MAX_BATCHES} batches (2048; quick 512)")
    args = common.parse(p, argv)
    args.batches = args.batches or (12 if args.quick else 30)
    args.mib_per_cell = args.mib_per_cell or (512 if args.quick else 2048)
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    sizes = [int(s) if s.is_integer() else s for s in sizes]

    raw = common.interleave(sizes, ARMS, lambda mib, arm, rep: measure(mib, arm, args),
                            reps=args.reps, warmup_reps=args.warmup_reps, label=NAME)
    text = render(raw, args)
    writers.write_outputs(args, text, {
        "raw": raw.as_json(),
        "summary": common.summaries(raw, METRICS, baseline="DataLoader")})
    if args.plot:
        plot(raw, args)


if __name__ == "__main__":
    main()
