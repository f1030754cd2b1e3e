"""Start-up under spawn and forkserver: time to the first batch and to the end of a
short epoch, torch DataLoader vs PoolLoader, for a dataset that holds a lot of
Python state.

Under spawn and forkserver (the default start method from Python 3.14) every worker
start pickles the worker's arguments — the dataset, worker_init_fn and collate_fn —
in the main process and unpickles them in the worker. DataLoader does it once per
worker, every epoch unless persistent_workers=True (pytorch/pytorch #139792, PR
#87802: a 2 GB dataset with 32 workers took ~30 min to the first batch). PoolLoader
pickles them once per iterator into shared memory and each worker unpickles its Python
objects from there, its arrays mapped rather than copied (poolloader.worker.startup),
so main's part does not grow with workers.

Dataset (`Annotated`): a COCO-style index held in Python objects — per image a file
name and a list of annotation dicts (bbox list, category, area, iscrowd, ids) —
`--state-mb` MB of pickle (default 200; quick 60); `__getitem__` returns a small
image tensor made from the index, so the epoch itself is short.

Cells: start method (`forkserver`, `spawn`) × workers (2, 4, 8; quick 2, 4). Arms:
DataLoader and PoolLoader with the same arguments (batch 8, `--batches` batches,
prefetch_factor 2, a multiprocessing context of that start method). Per measurement:
  first  seconds from `iter(loader)` to the first batch in hand;
  epoch  seconds from `iter(loader)` to the end of the epoch (every batch taken,
         workers shut down by the loader itself).
Repetitions interleave the arms in rotated order (bench/common.py); the table gives
median [min–max] over repetitions and DataLoader ÷ PoolLoader paired per repetition.

Usage:
    python bench/startup.py [--quick] [--workers 2,4,8] [--state-mb 200] [--out DIR]
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import procs  # noqa: E402
import torch  # noqa: E402
import writers  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from poolloader import PoolLoader  # noqa: E402

NAME = "startup"
BATCH = 8
METHODS = ("forkserver", "spawn")


class Annotated(Dataset):
    """`images` images of COCO-style Python state; item i is a 3×32×32 tensor of i."""

    def __init__(self, images: int):
        self.records = [
            {"file_name": f"train2017/{i:012d}.jpg", "id": i, "height": 480, "width": 640,
             "annotations": [{"id": i * 16 + k, "category_id": 1 + (i + k) % 80,
                              "bbox": [float(k), float(i % 640), 32.0 + k, 24.0 + k],
                              "area": float((32 + k) * (24 + k)), "iscrowd": 0,
                              "segmentation": [[float(k), 0.0, 8.0, 8.0, 16.0, 0.0]]}
                             for k in range(7)]}
            for i in range(images)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 32, 32), float(self.records[i]["id"]))


def build(state_mb: float) -> tuple[Annotated, int]:
    """A dataset whose pickle is about `state_mb` MB, and that size in bytes."""
    probe = Annotated(1000)
    per_image = len(pickle.dumps(probe, protocol=pickle.HIGHEST_PROTOCOL)) / 1000
    data = Annotated(max(1000, int(state_mb * 1e6 / per_image)))
    return data, len(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))


def measure(cell, arm: str, data, cfg) -> dict:
    method, workers = cell
    cls = PoolLoader if arm == "pool" else DataLoader
    loader = cls(data, batch_size=BATCH, num_workers=workers, prefetch_factor=2,
                 sampler=range(cfg.batches * BATCH), timeout=cfg.timeout,
                 multiprocessing_context=multiprocessing.get_context(method))
    t0 = time.perf_counter()
    it = iter(loader)
    procs.note_workers(it)
    first = next(it)
    t_first = time.perf_counter() - t0
    assert int(first[0, 0, 0, 0]) == 0
    del first  # a consumer that kept every batch would make PoolLoader detach slots
    count = 1
    for _batch in it:
        count += 1
    t_epoch = time.perf_counter() - t0
    if count != cfg.batches:
        raise common.BenchError(f"{count} batches, expected {cfg.batches}")
    del it, loader
    procs.wait_no_children()
    return {"first_s": t_first, "epoch_s": t_epoch}


def report(raw: common.Raw, meta: dict) -> str:
    rows = []
    for cell in raw.cells:
        method, workers = cell
        for arm, label in (("dl", "DataLoader"), ("pool", "PoolLoader")):
            rows.append([method, workers, label,
                         common.cell_text(raw, cell, arm, "first_s", ".2f"),
                         common.cell_text(raw, cell, arm, "epoch_s", ".2f"),
                         common.ratio_text(raw, cell, "dl", arm, "first_s") if arm == "pool" else "",
                         common.ratio_text(raw, cell, "dl", arm, "epoch_s") if arm == "pool" else ""])
    head = (f"## Start-up (bench/startup.py{' --quick' if meta['quick'] else ''})\n\n"
            f"dataset: {meta['images']} images of COCO-style Python state, pickle "
            f"{meta['state_bytes'] / 1e6:.0f} MB; batch {BATCH}, {meta['batches']} batches per "
            f"epoch; {meta['reps']} reps; {writers.env_line()}\n\n"
            "first = s from iter() to the first batch; epoch = s from iter() to the epoch's end "
            "(median [min–max]); DL ÷ Pool paired per repetition.\n\n")
    return head + writers.markdown_table(
        ["start method", "workers", "loader", "first s", "epoch s", "DL ÷ Pool first",
         "DL ÷ Pool epoch"], rows, "llrrrrr")


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__, reps=(3, 1), warmup_reps=(0, 0))
    p.add_argument("--workers", default=None, help='comma-separated (default "2,4,8"; quick "2,4")')
    p.add_argument("--state-mb", type=float, default=None, help="pickled dataset size (200; quick 60)")
    p.add_argument("--batches", type=int, default=16, help="batches per epoch")
    p.add_argument("--timeout", type=float, default=600.0)
    cfg = common.parse(p, argv)
    workers = [int(w) for w in (cfg.workers or ("2,4" if cfg.quick else "2,4,8")).split(",")]
    state_mb = cfg.state_mb or (60.0 if cfg.quick else 200.0)
    data, state_bytes = build(state_mb)
    cells = [(m, w) for m in METHODS for w in workers]
    raw = common.interleave(cells, ["dl", "pool"], lambda cell, arm, rep: measure(cell, arm, data, cfg),
                            reps=cfg.reps, warmup_reps=cfg.warmup_reps, label=NAME)
    meta = {"quick": cfg.quick, "images": len(data), "state_bytes": state_bytes,
            "batches": cfg.batches, "reps": cfg.reps, **writers.environment()}
    text = report(raw, meta)
    writers.write_outputs(cfg, text, {"meta": meta, "raw": raw.as_json(),
                                      "summary": common.summaries(raw, ["first_s", "epoch_s"], "dl")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
