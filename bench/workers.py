"""Loader throughput against num_workers: torch DataLoader vs PoolLoader.

Data (`--datasets`, default both):
  filled  `fixtures.synthetic.FilledDetectionDataset` at 576×576, mean 7
          instances: RF-DETR-shaped samples from cheap deterministic tensors,
          so workers are cheap and the hand-off weighs;
  jpeg    `CocoLikeDataset` over `make_coco_like` JPEGs (640×480, cached in the
          temp folder): Pillow decode, random flip, resize to `--resolution`,
          normalise — RF-DETR's worker work, so workers dominate.
Both go through `DetectionCollate` (padded images [16,3,H,W] + mask [16,H,W]);
targets as RF-DETR passes them today, a tuple of 16 dicts of 7 tensors
(`--targets dicts`, default), or packed one tensor per field (`--targets packed`).

Arms: `torch.utils.data.DataLoader` and `PoolLoader` with the same arguments
(batch 16, shuffle off, prefetch_factor 2, pin_memory off, default sharing
strategy, PoolLoader at its default 1 MiB initial slots).

Method, per cell (dataset × worker count × arm), via bench/common.py's
`interleave` and bench/workload.py's `measure_loader`:
create the loader, iterate it; `workers × 2 + 4` warm-up batches are drawn
and dropped untimed (worker start, every slot's first growth); then `--batches`
batches are timed (the data set holds `workers × 2 + 2` more batches than are
drawn, so the timed ones never come from a draining pipeline), each `next()` then `del`
with nothing else in between, so the
consumer is never the bottleneck. Reported per cell: img/s = 16 × batches /
wall time of the timed batches, and the main thread's CPU time per batch over
`next()` + `del` (`time.thread_time`, i.e. what receiving and releasing a batch
costs the training process, waiting excluded), and the CPU time of the whole
pipeline per batch (main process + workers, every thread, from /proc
schedstat over the timed window: far less sensitive to other work on the
machine than img/s). The iterator is shut down and
the children waited for between cells. Repetitions interleave the arms in a
rotated order; medians [min–max] over repetitions and paired PoolLoader /
DataLoader ratios per repetition. On a 2-core machine more workers than cores
only adds contention: the curve shows how much main-process cost each loader
adds to a saturated machine, not scaling.

Usage:
    python bench/workers.py [--quick] [--workers 2,4,8] [--datasets filled,jpeg]
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
from torch.utils.data import DataLoader  # noqa: E402

from fixtures.synthetic import CocoLikeDataset, FilledDetectionDataset  # noqa: E402
from poolloader import DetectionCollate, PoolLoader  # noqa: E402

NAME = "workers"
BATCH = 16
PREFETCH = 2
ARMS = ("DataLoader", "PoolLoader")
LOADERS = {"DataLoader": DataLoader, "PoolLoader": PoolLoader}
METRICS = ("img_s", "main_cpu_ms", "total_cpu_ms", "worker_cpu_ms", "main_proc_cpu_ms",
           "next_ms", "wait_share")


class Cycled(torch.utils.data.Dataset):
    """`base` repeated to `length` items (index modulo len(base))."""

    def __init__(self, base, length: int):
        self.base, self.length = base, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.base[index % len(self.base)]


def make_dataset(kind: str, length: int, args):
    if kind == "filled":
        return FilledDetectionDataset(length, resolution=576, instances=7, seed=args.seed)
    if kind == "jpeg":
        root, ann = workload.coco_like_data(args.images, args.seed)
        return Cycled(CocoLikeDataset(root, ann, resolution=args.resolution), length)
    raise ValueError(f"unknown dataset {kind!r}; choose filled or jpeg")


def measure(cell, arm, args) -> dict:
    kind, workers = cell
    warmup = workers * PREFETCH + 4
    batches = args.batches if kind == "filled" else args.jpeg_batches
    # Longer than what is drawn, so the timed batches come from a running
    # pipeline, not from draining the last prefetched ones.
    dataset = make_dataset(kind, BATCH * (warmup + batches + workers * PREFETCH + 2), args)
    loader = LOADERS[arm](dataset, batch_size=BATCH, shuffle=False, num_workers=workers,
                          collate_fn=DetectionCollate(pack=args.targets == "packed"),
                          prefetch_factor=PREFETCH)
    try:
        return workload.measure_loader(loader, warmup, batches, BATCH)
    finally:
        del loader
        left = procs.wait_clean()
        if left:
            raise RuntimeError(f"left behind after the cell: {left}")


def resolution(kind: str, args) -> int:
    return 576 if kind == "filled" else args.resolution


def render(raw, args) -> str:
    rows = []
    for kind, workers in raw.cells:
        cell = (kind, workers)
        rows.append([
            f"{kind} {resolution(kind, args)}²", workers,
            common.cell_text(raw, cell, "DataLoader", "img_s"),
            common.cell_text(raw, cell, "PoolLoader", "img_s"),
            common.ratio_text(raw, cell, "PoolLoader", "DataLoader", "img_s"),
            common.cell_text(raw, cell, "DataLoader", "main_cpu_ms", ".2f"),
            common.cell_text(raw, cell, "PoolLoader", "main_cpu_ms", ".2f"),
            common.ratio_text(raw, cell, "PoolLoader", "DataLoader", "main_cpu_ms"),
            common.cell_text(raw, cell, "DataLoader", "total_cpu_ms"),
            common.cell_text(raw, cell, "PoolLoader", "total_cpu_ms"),
            common.ratio_text(raw, cell, "PoolLoader", "DataLoader", "total_cpu_ms"),
        ])
    head = (f"Loader throughput vs num_workers: batch {BATCH}, targets {args.targets}, "
            f"{args.batches} timed batches (jpeg {args.jpeg_batches}) per cell after warm-up, "
            f"{args.reps} repetitions (+{args.warmup_reps} warm-up), median [min–max]; "
            f"ratios paired per repetition. {writers.env_line()}.")
    table = writers.markdown_table(
        ["data", "workers", "DataLoader img/s", "PoolLoader img/s", "Pool/DL img/s",
         "DataLoader main ms/batch", "PoolLoader main ms/batch", "Pool/DL main ms",
         "DataLoader CPU ms/batch", "PoolLoader CPU ms/batch", "Pool/DL CPU"], rows)
    return f"### {NAME}\n\n{head}\n\n{table}\n"


def plot(raw, args) -> str | None:
    kinds = list(dict.fromkeys(kind for kind, _ in raw.cells))
    paths = []
    for kind in kinds:
        cells = [c for c in raw.cells if c[0] == kind]
        xs = [w for _, w in cells]
        path = args.plot if len(kinds) == 1 else args.plot.replace(".png", f"-{kind}.png")
        done = writers.plot_sweep(
            path, xs, {arm: [common.summarize(raw.series(c, arm, "img_s")) for c in cells]
                       for arm in ARMS},
            xlabel="num_workers", ylabel="img/s",
            title=f"{kind} {resolution(kind, args)}², batch {BATCH}: loader throughput",
            ratios={"PoolLoader / DataLoader img/s":
                    [common.ratio(raw, c, "PoolLoader", "DataLoader", "img_s") for c in cells],
                    "PoolLoader / DataLoader main-thread ms":
                    [common.ratio(raw, c, "PoolLoader", "DataLoader", "main_cpu_ms") for c in cells],
                    "PoolLoader / DataLoader CPU ms (main + workers)":
                    [common.ratio(raw, c, "PoolLoader", "DataLoader", "total_cpu_ms") for c in cells]})
        paths.append(done)
    return paths


def main(argv=None) -> None:
    p = common.parser(NAME, __doc__)
    p.add_argument("--workers", default=None, help="comma-separated (default 2,3,4,6,8; quick 2,4,8)")
    p.add_argument("--datasets", default=None, help="filled,jpeg (default both; quick filled)")
    p.add_argument("--targets", choices=("dicts", "packed"), default="dicts")
    p.add_argument("--batches", type=int, default=None, help="timed batches, filled (40; quick 12)")
    p.add_argument("--jpeg-batches", type=int, default=None, help="timed batches, jpeg (24; quick 8)")
    p.add_argument("--resolution", type=int, default=None, help="jpeg resize (576; quick 320)")
    p.add_argument("--images", type=int, default=64, help="JPEGs generated for the jpeg data")
    p.add_argument("--seed", type=int, default=0)
    args = common.parse(p, argv)
    q = args.quick
    workers = [int(w) for w in (args.workers or ("2,4,8" if q else "2,3,4,6,8")).split(",")]
    kinds = (args.datasets or ("filled" if q else "filled,jpeg")).split(",")
    args.batches = args.batches or (12 if q else 40)
    args.jpeg_batches = args.jpeg_batches or (8 if q else 24)
    args.resolution = args.resolution or (320 if q else 576)
    if "jpeg" in kinds:
        workload.coco_like_data(args.images, args.seed)  # generate before anything is timed

    cells = [(kind, w) for kind in kinds for w in workers]
    raw = common.interleave(cells, ARMS, lambda cell, arm, rep: measure(cell, arm, args),
                            reps=args.reps, warmup_reps=args.warmup_reps, label=NAME)
    text = render(raw, args)
    writers.write_outputs(args, text, {
        "raw": raw.as_json(),
        "summary": common.summaries(raw, METRICS, baseline="DataLoader")})
    if args.plot:
        plot(raw, args)


if __name__ == "__main__":
    main()
