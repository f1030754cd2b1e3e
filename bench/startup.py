"""Start-up under fork, forkserver and spawn: time to the first batch, torch
DataLoader vs PoolLoader, cold (a fresh start) and at epoch 2 (persistent_workers=False:
every epoch starts its workers again), beside one fresh interpreter's `import torch`.

Under spawn and forkserver (the default start method from Python 3.14) every
DataLoader worker is a fresh interpreter that imports torch and the user's modules
again, and every worker start pickles the worker's arguments in main (the dataset,
worker_init_fn, collate_fn; pytorch/pytorch #139792). PoolLoader's workers are forked
by a zygote (poolloader.worker.zygote) that imported them once, and its arguments are
pickled once per iterator into shared memory (poolloader.worker.startup).

Dataset (`Annotated`): a COCO-style index held in Python objects, `--state-mb` MB of
pickle (default 0: one image per sample, a tiny dataset, where start-up is the
imports; with 1 or more, each spawn/forkserver worker of both loaders unpickles that
state: about 0.05 s per MB per worker here, on top); `__getitem__` returns a small
tensor made from the index.

Cells: start method (fork, forkserver, spawn) × workers (2, 4, 8, 16; quick 2, 8).
Arms: DataLoader and PoolLoader with the same arguments (batch 8, `--batches` batches,
prefetch_factor 2, a multiprocessing context of that start method). Per measurement:
  first   seconds from building the loader to the first batch in hand, cold: this
          process's zygotes are stopped first, so PoolLoader's includes starting one
          (it is started as the loader is built; DataLoader's global forkserver, which
          preloads nothing usable on Python 3.11, is left running);
  epoch   seconds from building the loader to the end of epoch 1;
  first2  seconds from the second iter() (epoch 2, persistent_workers=False) to its
          first batch: new workers, the zygote already running.
Each repetition also times `python -c "import torch"` (the floor of any fresh start).
Repetitions interleave the arms in rotated order (bench/common.py); the table gives
median [min–max] over repetitions and DataLoader ÷ PoolLoader paired per repetition.

Usage:
    python bench/startup.py [--quick] [--workers 2,4,8,16] [--methods fork,forkserver,spawn]
                            [--state-mb 0] [--reps 3] [--out DIR]
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import procs  # noqa: E402
import torch  # noqa: E402
import writers  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from poolloader import PoolLoader  # noqa: E402
from poolloader.worker import zygote  # noqa: E402

NAME = "startup"
BATCH = 8
METHODS = ("fork", "forkserver", "spawn")
IMPORT_FLOOR = []  # seconds of `python -c "import torch"`, one per repetition


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


def build(state_mb: float, least: int) -> tuple[Annotated, int]:
    """A dataset whose pickle is about `state_mb` MB (at least `least` images), and
    that size in bytes."""
    probe = Annotated(1000)
    per_image = len(pickle.dumps(probe, protocol=pickle.HIGHEST_PROTOCOL)) / 1000
    data = Annotated(max(least, int(state_mb * 1e6 / per_image)))
    return data, len(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))


def import_torch_s() -> float:
    """Wall seconds of a fresh interpreter that imports torch and exits."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=300)
    return time.perf_counter() - t0


def measure(cell, arm: str, data, cfg, rep: int) -> dict:
    method, workers = cell
    if cell == cfg.first_cell and arm == cfg.first_arm and rep >= 0:
        IMPORT_FLOOR.append(import_torch_s())
    cls = PoolLoader if arm == "pool" else DataLoader
    zygote.stop_all()  # cold: PoolLoader's first batch includes starting its zygote
    t0 = time.perf_counter()
    loader = cls(data, batch_size=BATCH, num_workers=workers, prefetch_factor=2,
                 sampler=range(cfg.batches * BATCH), timeout=cfg.timeout,
                 multiprocessing_context=multiprocessing.get_context(method))
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
    del it
    t0 = time.perf_counter()
    it = iter(loader)  # epoch 2: persistent_workers=False starts new workers
    procs.note_workers(it)
    next(it)
    t_first2 = time.perf_counter() - t0
    del it, loader
    procs.wait_no_children()
    return {"first_s": t_first, "epoch_s": t_epoch, "first2_s": t_first2}


def _targets(raw: common.Raw, floor: float, workers: int) -> list[str]:
    """Issue 46's targets at `workers` workers, each with the figures it compares."""
    lines = []
    fork = common.summarize(raw.series(("fork", workers), "pool", "first2_s")).median
    fork_dl = common.summarize(raw.series(("fork", workers), "dl", "first2_s")).median
    for method in ("forkserver", "spawn"):
        cell = (method, workers)
        if cell not in raw.cells:
            continue
        first = common.summarize(raw.series(cell, "pool", "first_s")).median
        speedup = common.ratio(raw, cell, "dl", "pool", "first_s").median
        second = common.summarize(raw.series(cell, "pool", "first2_s")).median
        lines.append(
            f"- {method}, {workers} workers: PoolLoader first {first:.2f} s vs import floor "
            f"{floor:.2f} s + 0.7 = {floor + 0.7:.2f} s ({'met' if first <= floor + 0.7 else 'MISSED'}); "
            f"DataLoader ÷ PoolLoader first {speedup:.1f}× ({'met' if speedup >= 3 else 'MISSED'} ≥ 3×); "
            f"epoch 2 first {second:.2f} s vs 2 × fork's {fork:.2f} s (PoolLoader; "
            f"{'met' if second <= 2 * fork else 'MISSED'}) or {fork_dl:.2f} s (DataLoader; "
            f"{'met' if second <= 2 * fork_dl else 'MISSED'})")
    return lines


def report(raw: common.Raw, meta: dict) -> str:
    rows = []
    for cell in raw.cells:
        method, workers = cell
        for arm, label in (("dl", "DataLoader"), ("pool", "PoolLoader")):
            pool = arm == "pool"
            rows.append([method, workers, label,
                         common.cell_text(raw, cell, arm, "first_s", ".2f"),
                         common.cell_text(raw, cell, arm, "first2_s", ".2f"),
                         common.cell_text(raw, cell, arm, "epoch_s", ".2f"),
                         common.ratio_text(raw, cell, "dl", arm, "first_s") if pool else "",
                         common.ratio_text(raw, cell, "dl", arm, "first2_s") if pool else ""])
    floor = common.summarize(meta["import_torch_s"])
    head = (f"## Start-up (bench/startup.py{' --quick' if meta['quick'] else ''})\n\n"
            f"dataset: {meta['images']} images of COCO-style Python state, pickle "
            f"{meta['state_bytes'] / 1e6:.1f} MB; batch {BATCH}, {meta['batches']} batches per "
            f"epoch; {meta['reps']} reps; {writers.env_line()}\n\n"
            f"fresh interpreter's `import torch` (the floor of a fresh start): "
            f"{floor.fmt('.2f')} s\n\n"
            "first = s from building the loader to the first batch (cold: no zygote running); "
            "first2 = s from epoch 2's iter() to its first batch (persistent_workers=False); "
            "epoch = s from building the loader to epoch 1's end (median [min–max]); "
            "DL ÷ Pool paired per repetition.\n\n")
    targets = _targets(raw, floor.median, 8) if ("fork", 8) in raw.cells else []
    return head + writers.markdown_table(
        ["start method", "workers", "loader", "first s", "first2 s", "epoch s",
         "DL ÷ Pool first", "DL ÷ Pool first2"], rows, "llrrrrrr") + (
        "\n\nIssue 46's targets:\n" + "\n".join(targets) + "\n" if targets else "")


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__, reps=(3, 1), warmup_reps=(0, 0))
    p.add_argument("--workers", default=None, help='comma-separated (default "2,4,8,16"; quick "2,8")')
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated start methods")
    p.add_argument("--state-mb", type=float, default=0.0,
                   help="pickled dataset size in MB (default 0: one image per sample)")
    p.add_argument("--batches", type=int, default=16, help="batches per epoch")
    p.add_argument("--timeout", type=float, default=600.0)
    cfg = common.parse(p, argv)
    workers = [int(w) for w in (cfg.workers or ("2,8" if cfg.quick else "2,4,8,16")).split(",")]
    methods = cfg.methods.split(",")
    data, state_bytes = build(cfg.state_mb, cfg.batches * BATCH)
    cells = [(m, w) for m in methods for w in workers]
    cfg.first_cell, cfg.first_arm = cells[0], "dl"
    raw = common.interleave(cells, ["dl", "pool"],
                            lambda cell, arm, rep: measure(cell, arm, data, cfg, rep),
                            reps=cfg.reps, warmup_reps=cfg.warmup_reps, label=NAME)
    meta = {"quick": cfg.quick, "images": len(data), "state_bytes": state_bytes,
            "batches": cfg.batches, "reps": cfg.reps, "import_torch_s": IMPORT_FLOOR,
            **writers.environment()}
    text = report(raw, meta)
    writers.write_outputs(cfg, text, {"meta": meta, "raw": raw.as_json(), "summary":
                                      common.summaries(raw, ["first_s", "first2_s", "epoch_s"], "dl")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
