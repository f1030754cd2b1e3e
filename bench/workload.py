"""The workload: the one RF-DETR-shaped fake data set and how a loader is measured on it.

Data: `RFDETRShaped` (batch of 16, per sample an image, a padding mask and
RF-DETR's 7 target tensors, built from precomputed tensors so workers are
cheap) and its collate (`RFDETRCollate`: what crosses the boundary is one of
`ROWS`, allocated where each loader wants it), plus `coco_like_data` (real JPEGs
from fixtures/).

Loaders: `measure_loader` (warm-up batches, then timed `next()` + `del` per
batch: wall time, the main thread's CPU time, the CPU time of the main process
and of the workers over the timed window, throughput), `shutdown_iterator`.

Nothing here imports torch or poolloader at import time (bench/fd_limits.py
sets its descriptor limit before either is loaded).
"""
from __future__ import annotations

import gc
import math
import os
import random
import statistics
import time

import common  # noqa: F401  (puts the repository on sys.path: fixtures/ is not installed)
from procs import cpu_ns, note_workers

BATCH = 16
RESOLUTION = 576
MAX_INSTANCES = 14  # n uniform in 0..14: mean 7, about 1 sample in 15 empty

# What crosses the worker -> main boundary (the collate's output; same data set).
ROWS = [
    ("count", "(a) batch size only"),
    ("image_mask", "(b) image + mask"),
    ("packed", "(c) + packed targets"),
    ("per_sample", "(d) + per-sample targets"),
]
ROW_LABEL = dict(ROWS)


def make_target(rng: random.Random, image_id: int, resolution: int = RESOLUTION,
                orig_hw=(480, 640)) -> dict:
    """RF-DETR's 7 target fields and dtypes, n uniform in 0..MAX_INSTANCES (may be 0)."""
    import torch

    n = rng.randint(0, MAX_INSTANCES)
    boxes = torch.tensor([[rng.random() for _ in range(4)] for _ in range(n)],
                         dtype=torch.float32).reshape(n, 4)
    return {
        "boxes": boxes,
        "labels": torch.tensor([rng.randrange(1, 91) for _ in range(n)], dtype=torch.int64),
        "image_id": torch.tensor([image_id], dtype=torch.int64),
        "area": boxes[:, 2] * boxes[:, 3] * float(resolution * resolution),
        "iscrowd": torch.zeros(n, dtype=torch.int64),
        "orig_size": torch.tensor(list(orig_hw), dtype=torch.int64),
        "size": torch.tensor([resolution, resolution], dtype=torch.int64),
    }


class RFDETRShaped:
    """`(image f32 [3,R,R], mask bool [R,R], target)` from precomputed tensors.

    The hand-off, not the worker, costs: the image and mask are returned as
    they are (collate copies them into the batch); the target's 7 tensors are
    cloned, as a real dataset builds fresh ones per sample. `distinct_images`
    random images and `distinct_targets` targets (`make_target`) are cycled;
    deterministic in (seed, index). Map-style without subclassing torch's
    Dataset, so this module imports without torch.
    """

    def __init__(self, length: int, resolution: int = RESOLUTION, seed: int = 0,
                 distinct_images: int = 4, distinct_targets: int = 64):
        import torch

        self.length = length
        g = torch.Generator().manual_seed(seed)
        self.images = [torch.rand(3, resolution, resolution, generator=g)
                       for _ in range(distinct_images)]
        self.mask = torch.zeros(resolution, resolution, dtype=torch.bool)
        rng = random.Random(seed)
        self.targets = [make_target(rng, i, resolution) for i in range(distinct_targets)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} items")
        return (self.images[index % len(self.images)], self.mask,
                {k: v.clone() for k, v in self.targets[index % len(self.targets)].items()})


def _shared_empty(shape, dtype):
    """In a DataLoader worker: a tensor straight in a shared segment, as
    default_collate allocates (no copy at pickling). Elsewhere torch.empty."""
    import torch
    from torch.utils.data import get_worker_info

    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    elem = torch.empty(0, dtype=dtype)
    storage = elem._typed_storage()._new_shared(math.prod(shape), device=elem.device)
    return elem.new(storage).resize_(*shape)


class RFDETRCollate:
    """Collate `RFDETRShaped` samples into what crosses the boundary for `row`
    (see ROWS): the big tensors are allocated where `pool` (PoolLoader:
    `poolloader.slot_empty`, straight into the slot) or DataLoader (a shared
    segment, as default_collate does in a worker) wants them; targets are
    packed with `poolloader.pack_targets` ("packed") or kept as the 16 dicts
    ("per_sample")."""

    def __init__(self, row: str, pool: bool):
        if row not in ROW_LABEL:
            raise ValueError(f"unknown row {row!r}; choose from {list(ROW_LABEL)}")
        self.row, self.pool = row, pool

    def _empty(self, shape, dtype):
        if self.pool:
            from poolloader import slot_empty
            return slot_empty(shape, dtype)
        return _shared_empty(shape, dtype)

    def __call__(self, samples):
        import torch

        b = len(samples)
        if self.row == "count":
            out = self._empty((1,), torch.int64)
            out.fill_(b)
            return out
        image0, mask0, _ = samples[0]
        images = self._empty((b, *image0.shape), image0.dtype)
        torch.stack([s[0] for s in samples], 0, out=images)
        mask = self._empty((b, *mask0.shape), torch.bool)
        torch.stack([s[1] for s in samples], 0, out=mask)
        if self.row == "image_mask":
            return images, mask
        targets = [s[2] for s in samples]
        if self.row == "packed":
            from poolloader import pack_targets
            return images, mask, pack_targets(targets)
        return images, mask, tuple(targets)


class IntsCollate:
    """A batch with no tensor at all: a dict of Python ints (the batch size and each
    sample's box count), for the fixed cost of a batch (bench/stages.py --fixed-cost)."""

    def __call__(self, samples):
        return {"size": len(samples), "boxes": [int(s[2]["labels"].numel()) for s in samples]}


def tensors_in(obj) -> list:
    """Every tensor reachable in a batch (PackedTargets: its fields and counts)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    fields = getattr(obj, "fields", None)
    if isinstance(fields, dict):
        return tensors_in(fields) + tensors_in(getattr(obj, "counts", None))
    return []


def coco_like_data(images: int, seed: int, root: str | None = None) -> tuple[str, str]:
    """(root, annotation file) of the synthetic JPEG data set, from this user's
    verified cache (or `root`); see fixtures/synthetic.py."""
    from fixtures.synthetic import cached_coco_like

    return cached_coco_like(images, seed, root)


def measure_loader(loader, warmup_batches: int, batches: int, images_per_batch: int) -> dict:
    """Iterate `loader` once: `warmup_batches` untimed, then `batches` timed.

    Per timed batch: wall time of `next()` and of `del batch`, and the main
    thread's CPU time over both (`time.thread_time`: the main-process cost of
    receiving and releasing a batch, without the time spent blocked waiting for
    a worker; a loader that spins while waiting is charged for the spin).
    Over the timed window: CPU time of the main process (all threads) and of
    the workers (all threads), per batch, from /proc schedstat: what the whole
    pipeline costs the machine, which a busy machine inflates far less than
    wall time. Throughput: images over the wall time of the timed batches (the
    consumer does nothing else, so this is the loader's own rate). The iterator
    is shut down before returning, and a PoolLoader's `stats` are read before that.
    The dataset should hold more than warmup_batches + batches batches, so the
    timed ones do not come from a draining pipeline.
    """
    it = iter(loader)
    try:
        for _ in range(warmup_batches):
            batch = next(it)
            del batch
        stats0 = loader.stats.as_dict() if hasattr(loader, "stats") else None
        workers = note_workers(it)
        next_ms, del_ms, cpu_ms = [], [], []
        main0 = cpu_ns(os.getpid())
        workers0 = sum(cpu_ns(pid) for pid in workers)
        start = time.perf_counter()
        for _ in range(batches):
            c0, t0 = time.thread_time(), time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            del batch
            t2 = time.perf_counter()
            cpu_ms.append((time.thread_time() - c0) * 1e3)
            next_ms.append((t1 - t0) * 1e3)
            del_ms.append((t2 - t1) * 1e3)
        wall = time.perf_counter() - start
        main_total = cpu_ns(os.getpid()) - main0
        workers_total = sum(cpu_ns(pid) for pid in workers) - workers0
        stats = loader.stats.as_dict() if hasattr(loader, "stats") else None
    finally:
        shutdown_iterator(it)
        del it
    out = {
        "img_s": images_per_batch * batches / wall,
        "batch_s": batches / wall,
        "main_cpu_ms": statistics.median(cpu_ms),
        "next_ms": statistics.median(next_ms),
        "del_ms": statistics.median(del_ms),
        "wait_share": sum(next_ms) / 1e3 / wall,
        "main_proc_cpu_ms": main_total / 1e6 / batches,
        "worker_cpu_ms": workers_total / 1e6 / batches,
        "total_cpu_ms": (main_total + workers_total) / 1e6 / batches,
    }
    if stats is not None:
        out["slot_growths_timed"] = stats["slot_growths"] - stats0["slot_growths"]
        out["slot_mib"] = stats["slot_bytes"] / 2**20
    return out


def shutdown_iterator(it) -> None:
    """Stop a loader iterator's workers now (DataLoader's and PoolLoader's both
    have `_shutdown_workers`; otherwise rely on garbage collection)."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
    gc.collect()
