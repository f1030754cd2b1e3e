"""Headline benchmark: what a batch costs the main process when it crosses the
worker -> main boundary, for torch's DataLoader (both sharing strategies) and
PoolLoader, side by side in one run.

It reproduces the ablation of RF-DETR PR #1399 (DESIGN.md, "The problem, in
numbers") on the RF-DETR detection shape: batch 16, 576x576; per sample an image
float32 [3,576,576], a bool padding mask [576,576] and a target dict of 7
tensors (boxes [n,4] f32, labels [n] i64, image_id [1] i64, area [n] f32,
iscrowd [n] i64, orig_size [2] i64, size [2] i64; n uniform in 0..14, mean 7,
some samples empty).

Ablation rows (only the collate output changes; the dataset is the same):
  (a) count       the batch size only, as a 1-element tensor          (1 tensor)
  (b) image_mask  images [16,3,576,576] + mask [16,576,576]           (2 tensors)
  (c) packed      (b) + targets packed one tensor per field + counts
                  (`poolloader.detection.pack_targets`)                (2 + 8 = 10)
  (d) per_sample  (b) + the 16 target dicts as they are               (2 + 112 = 114)
The table reports the tensor count actually found in a delivered batch.

Arms (loaders), run on the same data in the same process run:
  DataLoader with `torch.multiprocessing.set_sharing_strategy("file_descriptor")`
  (torch's default on Linux) and with "file_system", each set before the loader
  is created and restored after it is shut down; and PoolLoader (default options:
  1 MiB slots that grow on the first batches, which the warm-up excludes).
  Collates allocate the big tensors where each loader wants them: DataLoader's
  arm like `default_collate` in a worker (straight into a shared segment, no
  extra copy), PoolLoader's with `poolloader.slot_empty` (straight into the slot).

Dataset: `--dataset cheap` (default) returns precomputed tensors (the image is
returned as is, the 7 target tensors are cloned, as a real dataset builds them
fresh), so workers are not the bottleneck and the boundary is what is measured.
`--dataset jpeg` decodes real JPEGs: `poolloader.synthetic.make_coco_like` +
`CocoLikeDataset(resolution=576)` when that module exists, else 32 noise JPEGs
written with Pillow and decoded/resized in `__getitem__`.

Method, per cell (workers x row x arm), per repetition:
  1. Create the loader over a range sampler of exactly the batches the cell
     uses (plus one prefetch depth), `iter()` it, pull and drop warm-up batches
     (2 x (workers x prefetch + 2) + 2: every PoolLoader slot has grown by then;
     slot growths during the timed phases are recorded and should be 0).
  2. Latency phase, `--samples` times: wait until the prefetch queue is full
     (sleep `--settle-ms`, then poll every 1 ms until every outstanding batch is
     done: DataLoader `_data_queue.qsize() >= _tasks_outstanding`, PoolLoader
     `sum(len(done ring)) >= len(_inflight)`; bounded by --max-settle-ms), then
     take two batches, timing each:
       next ms = wall time of `batch = next(it)` (unpickle / rebuild / decode),
       drop ms = wall time of `del batch` (DataLoader: unmap and close or
                 decref every shared segment; PoolLoader: release the slot lease).
     The first batch after the sleep is the headline figure ("next", "drop");
     the second, taken right after it and also already done, is "warm". The
     difference is the main process's cold start after sleeping: the workers
     ran on the same 2 cores meanwhile and evicted its caches (on this machine
     that alone costs PoolLoader ~0.3 ms).
     After each timed `del`, two weak references (first and last tensor) check
     that the batch really died by reference counting; if it did not, a
     `gc.collect()` frees it (untimed) and the sample is flagged in the JSON.
     Samples whose queue was not full in time are flagged and excluded from
     the next-ms statistic when at least half are fine.
  3. Throughput phase, free-running: workers x prefetch + 2 batches unmeasured,
     then `--tp-batches` batches `next(); del` as fast as they come:
     img/s = 16 x batches / wall time.
  4. fds = len(os.listdir('/proc/self/fd')) at the end of the throughput pass,
     iterator alive and the last batch still held (also the peak during the
     latency phase and the baseline before the loader, in the JSON).
  5. Drain the rest of the epoch (so no batch is left in a queue: the
     file_system strategy would otherwise leave its names in /dev/shm until
     this process exits), shut the workers down, restore the sharing strategy,
     collect garbage, wait (<= 10 s) until no child process is left.
  Per cell and repetition the statistic is the median over the samples; the
  table shows the median [min-max] of those over `--reps` repetitions. Within a
  repetition the three arms of one (workers, row) run back to back, in an order
  rotated from one repetition (and row) to the next. Ratios (DataLoader /
  PoolLoader next+drop, PoolLoader / DataLoader img/s) are computed per
  repetition between arms measured side by side, then summarised the same way.
  On a shared 2-core machine absolute times are noise; the ratios are the figures.
  At the end the run checks that no child process and no /dev/shm name of its
  own (pl2-<this pid>-*, torch_<worker pid>_*) is left, and exits 1 if one is.

A cell that fails is reported as FAILED with its error and the run goes on.
Loaders get `timeout=--timeout` (60 s): DataLoader's worker-side failure at a
low descriptor limit ("Too many open files" in the result queue's feeder
thread) drops the batch and would otherwise hang the main process; the cell's
stderr is captured so the failure names that cause. Main-side failures
("received 0 items of ancdata") raise directly. `--nofile N` sets the soft
descriptor limit first (1024 reproduces the stock limit of the seed's crash).

`--profile ROW` runs one cell of `--profile-arm` (default pool) under cProfile,
timing only next() + del after a sleep, and prints the top entries instead of
the ablation. `--from-json PATH` re-renders the tables (and `--plot`) from a
previous `--json` file.

Usage:
  python bench/handoff.py [--quick] [--workers 2,4] [--reps 3]
                          [--dataset cheap|jpeg] [--json PATH] [--plot PATH]
                          [--markdown PATH] [--nofile N] [--timeout S]
                          [--profile per_sample] [--from-json PATH]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import platform
import pstats
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import weakref

import torch
import torch.multiprocessing as torch_mp
from torch.utils.data import DataLoader, Dataset, get_worker_info

from poolloader import PoolLoader, slot_empty
from poolloader.pool import NAME_TAG

try:
    from poolloader.detection import pack_targets as _pool_pack_targets
    PACKER = "poolloader.detection.pack_targets"
except ImportError:  # not written yet: a minimal local packer (see local_pack_targets)
    _pool_pack_targets = None
    PACKER = "local packer in bench/handoff.py (poolloader.detection missing)"

BATCH = 16
RESOLUTION = 576
MAX_INSTANCES = 14  # n uniform in 0..14: mean 7, about 1 sample in 15 empty
SHM_DIR = "/dev/shm"

ROWS = [
    ("count", "(a) batch size only"),
    ("image_mask", "(b) image + mask"),
    ("packed", "(c) + packed targets"),
    ("per_sample", "(d) + per-sample targets"),
]
ROW_LABEL = dict(ROWS)


class Arm:
    def __init__(self, key, label, loader_cls, strategy):
        self.key, self.label, self.loader_cls, self.strategy = key, label, loader_cls, strategy

    @property
    def pool(self) -> bool:
        return self.loader_cls is PoolLoader


ARMS = [
    Arm("dl_fd", "DataLoader file_descriptor", DataLoader, "file_descriptor"),
    Arm("dl_fs", "DataLoader file_system", DataLoader, "file_system"),
    Arm("pool", "PoolLoader", PoolLoader, None),
]
ARM_BY_KEY = {a.key: a for a in ARMS}
DL_ARMS = [a for a in ARMS if not a.pool]


# ---------------------------------------------------------------------------
# data

def make_target(rng: random.Random, image_id: int, orig_hw=(480, 640)) -> dict:
    """RF-DETR's 7 target fields and dtypes, n instances (n may be 0)."""
    n = rng.randint(0, MAX_INSTANCES)
    boxes = torch.tensor([[rng.random() for _ in range(4)] for _ in range(n)],
                         dtype=torch.float32).reshape(n, 4)
    return {
        "boxes": boxes,
        "labels": torch.tensor([rng.randrange(1, 91) for _ in range(n)], dtype=torch.int64),
        "image_id": torch.tensor([image_id], dtype=torch.int64),
        "area": boxes[:, 2] * boxes[:, 3] * float(RESOLUTION * RESOLUTION),
        "iscrowd": torch.zeros(n, dtype=torch.int64),
        "orig_size": torch.tensor(list(orig_hw), dtype=torch.int64),
        "size": torch.tensor([RESOLUTION, RESOLUTION], dtype=torch.int64),
    }


def _fresh(target: dict) -> dict:
    return {k: v.clone() for k, v in target.items()}


class CheapDetection(Dataset):
    """`(image, mask, target)` from precomputed tensors: the hand-off, not the worker, costs.

    The image and mask are returned as they are (collate copies them into the
    batch); the target's 7 tensors are cloned, as a real dataset builds fresh
    ones per sample. Deterministic in (seed, index).
    """

    def __init__(self, length: int, seed: int = 0, distinct_images: int = 4,
                 distinct_targets: int = 64):
        self.length = length
        g = torch.Generator().manual_seed(seed)
        self.images = [torch.rand(3, RESOLUTION, RESOLUTION, generator=g)
                       for _ in range(distinct_images)]
        self.mask = torch.zeros(RESOLUTION, RESOLUTION, dtype=torch.bool)
        rng = random.Random(seed)
        self.targets = [make_target(rng, i) for i in range(distinct_targets)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return (self.images[index % len(self.images)], self.mask,
                _fresh(self.targets[index % len(self.targets)]))


class CocoLikeWithMask(Dataset):
    """`poolloader.synthetic.CocoLikeDataset` items plus a padding mask (all False:
    every image is resized to the same square), cycled to `length` items."""

    def __init__(self, base, length: int):
        self.base, self.length = base, length
        self.mask = torch.zeros(RESOLUTION, RESOLUTION, dtype=torch.bool)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        image, target = self.base[index % len(self.base)]
        return image, self.mask, target


class NoiseJpegDetection(Dataset):
    """Fallback jpeg dataset: noise JPEGs decoded, resized and normalised per item."""

    MEAN = (0.485, 0.456, 0.406)
    STD = (0.229, 0.224, 0.225)

    def __init__(self, root: str, length: int, num_images: int = 32, seed: int = 0):
        import numpy as np
        from PIL import Image
        self.root, self.length = root, length
        rng_np = np.random.default_rng(seed)
        self.files = []
        for i in range(num_images):
            path = os.path.join(root, f"{i:06d}.jpg")
            Image.fromarray(rng_np.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(
                path, "JPEG", quality=90)
            self.files.append(path)
        rng = random.Random(seed)
        self.targets = [make_target(rng, i) for i in range(num_images)]
        self.mask = torch.zeros(RESOLUTION, RESOLUTION, dtype=torch.bool)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        import numpy as np
        from PIL import Image
        k = index % len(self.files)
        with Image.open(self.files[k]) as f:
            img = f.convert("RGB").resize((RESOLUTION, RESOLUTION), Image.Resampling.BILINEAR)
        arr = np.asarray(img, dtype=np.float32) / 255.0
        arr = (arr - np.asarray(self.MEAN, np.float32)) / np.asarray(self.STD, np.float32)
        image = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
        return image, self.mask, _fresh(self.targets[k])


def build_dataset(kind: str, length: int, tmpdir: str):
    """(dataset, description)."""
    if kind == "cheap":
        return CheapDetection(length), "cheap: precomputed tensors (targets cloned per item)"
    try:
        from poolloader.synthetic import CocoLikeDataset, make_coco_like
    except ImportError:
        return (NoiseJpegDetection(tmpdir, length),
                "jpeg: 32 noise JPEGs 640x480 (Pillow decode + resize; poolloader.synthetic missing)")
    ann = make_coco_like(tmpdir, 32, seed=0)
    return (CocoLikeWithMask(CocoLikeDataset(tmpdir, ann, resolution=RESOLUTION), length),
            "jpeg: poolloader.synthetic.make_coco_like(32 images 640x480) + CocoLikeDataset(576)")


# ---------------------------------------------------------------------------
# collate

class LocalPacked:
    """Minimal packed targets: each field concatenated along dim 0, plus counts.
    Used only when poolloader.detection is missing."""

    __slots__ = ("fields", "counts")

    def __init__(self, fields: dict, counts: torch.Tensor):
        self.fields, self.counts = fields, counts

    def __reduce__(self):
        return (LocalPacked, (self.fields, self.counts))


def local_pack_targets(targets):
    keys = list(targets[0])
    fields = {k: torch.cat([t[k] for t in targets], 0) for k in keys}
    counts = torch.tensor([t["labels"].shape[0] for t in targets], dtype=torch.int64)
    return LocalPacked(fields, counts)


def pack_targets(targets):
    if _pool_pack_targets is not None:
        return _pool_pack_targets(targets)
    return local_pack_targets(targets)


def _shared_empty(shape, dtype) -> torch.Tensor:
    """In a DataLoader worker: a tensor straight in a shared segment, as
    default_collate allocates (no copy at pickling). Elsewhere torch.empty."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    elem = torch.empty(0, dtype=dtype)
    storage = elem._typed_storage()._new_shared(math.prod(shape), device=elem.device)
    return elem.new(storage).resize_(*shape)


class HandoffCollate:
    """The ablation's collate: what crosses the boundary is `row`; the big
    tensors are allocated where `pool` (PoolLoader) or DataLoader wants them."""

    def __init__(self, row: str, pool: bool):
        if row not in ROW_LABEL:
            raise ValueError(f"unknown row {row!r}; choose from {list(ROW_LABEL)}")
        self.row, self.pool = row, pool

    def _empty(self, shape, dtype):
        return slot_empty(shape, dtype) if self.pool else _shared_empty(shape, dtype)

    def __call__(self, samples):
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
            return images, mask, pack_targets(targets)
        return images, mask, tuple(targets)


def tensors_in(obj) -> list:
    """Every tensor reachable in a batch (PackedTargets: its fields and counts)."""
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


# ---------------------------------------------------------------------------
# process hygiene

def count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_children() -> dict:
    """{pid: cmdline} of this process's children that are not zombies."""
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 2:].split()
            if int(fields[1]) != me or fields[0] in (b"Z", b"X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
    return out


def wait_no_children(timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        children = live_children()
        if not children or time.monotonic() > deadline:
            return children
        time.sleep(0.05)


def shm_names() -> set:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


# pids of every worker this run started: /dev/shm names are ours when they carry
# our pid (PoolLoader: "pl2-<main pid>-...") or a worker's (torch: "torch_<pid>_...").
# Other processes on the machine may create and remove names meanwhile.
OUR_PIDS = {os.getpid()}


def ours(name: str) -> bool:
    for prefix, sep in ((NAME_TAG + "-", "-"), ("torch_", "_")):
        if name.startswith(prefix):
            head = name[len(prefix):].split(sep, 1)[0]
            return head.isdigit() and int(head) in OUR_PIDS
    return False


def shm_manager_pids() -> list:
    """torch_shm_manager processes (file_system strategy's daemon), read-only."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"torch_shm_manager" in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


# ---------------------------------------------------------------------------
# one cell

def all_ready(it):
    """True when every outstanding batch of `it` is done and waiting for main;
    None when the iterator's internals are not what this bench expects."""
    try:
        if hasattr(it, "_done_rings"):  # PoolLoader
            return sum(len(r) for r in it._done_rings) >= len(it._inflight)
        return it._data_queue.qsize() >= it._tasks_outstanding  # DataLoader
    except Exception:
        return None


def wait_ready(it, settle_s: float, max_s: float):
    """Sleep settle_s, then poll until the prefetch queue is full. (ready, waited s)."""
    t0 = time.perf_counter()
    time.sleep(settle_s)
    while True:
        ready = all_ready(it)
        waited = time.perf_counter() - t0
        if ready is None:
            return None, waited
        if ready or waited >= max_s:
            return ready, waited
        time.sleep(0.001)


class StderrCapture:
    """Send fd 2 (ours and the workers' we fork) to a file for one cell, then echo it.

    A DataLoader worker whose result-queue feeder cannot pickle a batch (e.g.
    "Too many open files") prints the traceback and drops the batch; the main
    process only sees a timeout. The captured text lets the cell name the cause.
    """

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "cell-stderr.txt")
        self.text = ""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        with open(self.path, errors="replace") as f:
            self.text = f.read()
        os.unlink(self.path)
        if self.text:
            sys.stderr.write(self.text)
            sys.stderr.flush()
        return False

    def cause(self) -> str | None:
        """The last line that looks like an exception in the captured text."""
        lines = [ln.strip() for ln in self.text.splitlines()
                 if "Error" in ln or "ancdata" in ln or "Too many open files" in ln]
        return lines[-1][:300] if lines else None


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def make_loader(arm: Arm, row: str, workers: int, dataset, cfg, batches: int):
    """`batches` batches of the first items (a range sampler: the cell can drain its epoch)."""
    kwargs = dict(batch_size=BATCH, num_workers=workers, collate_fn=HandoffCollate(row, arm.pool),
                  sampler=range(batches * BATCH), pin_memory=False, drop_last=True,
                  prefetch_factor=cfg.prefetch, timeout=cfg.timeout)
    return arm.loader_cls(dataset, **kwargs)


def cell_batches(workers: int, cfg) -> tuple[int, int, int]:
    """(warm-up, throughput warm-up, total batches the cell's sampler yields)."""
    in_flight = workers * cfg.prefetch
    warmup = 2 * (in_flight + 2) + 2
    tp_warmup = in_flight + 2
    total = warmup + 2 * cfg.samples + tp_warmup + cfg.tp_batches + in_flight
    return warmup, tp_warmup, total


def run_cell(arm: Arm, row: str, workers: int, dataset, cfg) -> dict:
    res = {"arm": arm.key, "row": row, "workers": workers, "ok": False, "error": None}
    strategy_before = torch_mp.get_sharing_strategy()
    res["strategy"] = arm.strategy or strategy_before
    warmup, tp_warmup, total = cell_batches(workers, cfg)
    pair = workers * cfg.prefetch >= 2  # a full queue holds a second ready batch
    loader = it = batch = None
    try:
        if arm.strategy:
            torch_mp.set_sharing_strategy(arm.strategy)
        res["fds_baseline"] = count_fds()
        loader = make_loader(arm, row, workers, dataset, cfg, total)
        it = iter(loader)
        OUR_PIDS.update(w.pid for w in getattr(it, "_workers", ()))
        for _ in range(warmup):
            batch = next(it)
            del batch
        growths0 = loader.stats.slot_growths if arm.pool else 0
        timed = {"cold": ([], []), "warm": ([], [])}
        ready_flags, settles, not_freed, fds_peak = [], [], 0, 0
        for _ in range(cfg.samples):
            ready, waited = wait_ready(it, cfg.settle_s, cfg.max_settle_s)
            ready_flags.append(ready)
            settles.append(round(waited * 1e3, 2))
            for kind in ("cold", "warm") if pair else ("cold",):
                t0 = time.perf_counter_ns()
                batch = next(it)
                t1 = time.perf_counter_ns()
                found = tensors_in(batch)
                res["tensors"] = len(found)
                probes = (weakref.ref(found[0]), weakref.ref(found[-1]))
                del found
                fds_peak = max(fds_peak, count_fds())
                t2 = time.perf_counter_ns()
                del batch
                t3 = time.perf_counter_ns()
                if any(p() is not None for p in probes):
                    not_freed += 1
                    gc.collect()
                del probes
                timed[kind][0].append((t1 - t0) / 1e6)
                timed[kind][1].append((t3 - t2) / 1e6)
        for _ in range(tp_warmup):
            batch = next(it)
            del batch
        t0 = time.perf_counter()
        for i in range(cfg.tp_batches):
            batch = next(it)
            if i + 1 < cfg.tp_batches:
                del batch
        elapsed = time.perf_counter() - t0
        res["fds"] = count_fds()  # end of the pass: iterator alive, last batch held
        del batch
        if arm.pool:
            res["pool_stats"] = loader.stats.as_dict()
        drained = 0
        for batch in it:  # the rest of the epoch, so nothing is left in a queue
            del batch
            drained += 1
        res["drained"] = drained
        nexts, drops = timed["cold"]
        ready_idx = [i for i, r in enumerate(ready_flags) if r is not False]
        use = ready_idx if len(ready_idx) * 2 >= len(nexts) else list(range(len(nexts)))
        res.update({
            "ok": True,
            "next_ms": statistics.median(nexts[i] for i in use),
            "drop_ms": statistics.median(drops),
            "sum_ms": statistics.median(nexts[i] + drops[i] for i in use),
            "sum_p25_ms": quantile([nexts[i] + drops[i] for i in use], 0.25),
            "img_s": BATCH * cfg.tp_batches / elapsed,
            "fds_peak": fds_peak,
            "not_ready": sum(1 for r in ready_flags if r is False),
            "not_freed_by_del": not_freed,
            "samples_next_ms": [round(x, 4) for x in nexts],
            "samples_drop_ms": [round(x, 4) for x in drops],
            "settle_ms": settles,
            "slot_growths_timed": (loader.stats.slot_growths - growths0) if arm.pool else 0,
        })
        if pair:
            wn, wd = timed["warm"]
            res.update({
                "warm_next_ms": statistics.median(wn), "warm_drop_ms": statistics.median(wd),
                "warm_sum_ms": statistics.median(a + b for a, b in zip(wn, wd)),
                "warm_sum_p25_ms": quantile([a + b for a, b in zip(wn, wd)], 0.25),
                "samples_warm_next_ms": [round(x, 4) for x in wn],
                "samples_warm_drop_ms": [round(x, 4) for x in wd],
            })
    except Exception as exc:  # a failed cell is a result, not the end of the run
        res["error"] = _error_text(exc)
    finally:
        batch = None
        if it is not None:
            try:
                it._shutdown_workers()
            except Exception as exc:
                res["shutdown_error"] = _error_text(exc)
        del it, loader
        gc.collect()
        torch_mp.set_sharing_strategy(strategy_before)
        left = wait_no_children()
        if left:
            res["leftover_children"] = {str(k): v for k, v in left.items()}
    return res


# ---------------------------------------------------------------------------
# summaries

def quantile(values, q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty list."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def spread(values):
    """(median, min, max) or None."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def fmt_num(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def fmt_spread(s, suffix="") -> str:
    if s is None:
        return "—"
    med, lo, hi = s
    return f"{fmt_num(med)}{suffix} [{fmt_num(lo)}–{fmt_num(hi)}]"


def summarise(results, workers_list, rows):
    """{(workers, row, arm): summary dict} with per-rep paired ratios."""
    by = {}
    for r in results:
        by.setdefault((r["workers"], r["row"], r["arm"]), {})[r["rep"]] = r
    out = {}
    for w in workers_list:
        for row in rows:
            pool_reps = by.get((w, row, "pool"), {})
            for arm in ARMS:
                cells = by.get((w, row, arm.key), {})
                ok = {rep: c for rep, c in cells.items() if c["ok"]}
                s = {"n_ok": len(ok), "n": len(cells),
                     "errors": sorted({c["error"] for c in cells.values() if c["error"]})}
                for key in ("next_ms", "drop_ms", "sum_ms", "sum_p25_ms", "warm_next_ms",
                            "warm_drop_ms", "warm_sum_ms", "warm_sum_p25_ms", "img_s", "fds",
                            "fds_peak"):
                    s[key] = spread([c.get(key) for c in ok.values()])
                s["tensors"] = sorted({c["tensors"] for c in ok.values() if "tensors" in c})
                s["not_ready"] = sum(c.get("not_ready", 0) for c in ok.values())
                s["not_freed"] = sum(c.get("not_freed_by_del", 0) for c in ok.values())
                s["slot_growths_timed"] = sum(c.get("slot_growths_timed", 0) for c in ok.values())
                if not arm.pool:
                    pairs = [(c, pool_reps[rep]) for rep, c in ok.items()
                             if rep in pool_reps and pool_reps[rep]["ok"]]
                    s["x_sum"] = spread([c["sum_ms"] / p["sum_ms"] for c, p in pairs if p["sum_ms"] > 0])
                    s["x_warm"] = spread([c["warm_sum_ms"] / p["warm_sum_ms"] for c, p in pairs
                                          if c.get("warm_sum_ms") and p.get("warm_sum_ms")])
                    s["x_img"] = spread([p["img_s"] / c["img_s"] for c, p in pairs])
                out[(w, row, arm.key)] = s
    return out


def markdown(summary, workers_list, rows, header) -> str:
    lines = list(header)
    rows = [(r, ROW_LABEL[r]) for r in rows]
    short = {"dl_fd": "DataLoader fd", "dl_fs": "DataLoader fs", "pool": "PoolLoader"}
    for w in workers_list:
        lines += ["", f"### {w} workers — main-process cost per batch, median [min–max] over reps", "",
                  "| what crosses | loader | tensors | next ms | drop ms | next+drop ms "
                  "| DL ÷ Pool | warm next+drop ms | DL ÷ Pool (warm) | img/s | Pool ÷ DL (img/s) "
                  "| fds |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row, label in rows:
            for arm in ARMS:
                s = summary[(w, row, arm.key)]
                name = short[arm.key]
                if s["n_ok"] == 0:
                    err = "; ".join(s["errors"]) or "no result"
                    lines.append(f"| {label} | {name} | — | FAILED | {err} | | | | | | | |")
                    continue
                partial = f" ({s['n_ok']}/{s['n']} ok)" if s["n_ok"] < s["n"] else ""
                tensors = ",".join(map(str, s["tensors"]))
                x_sum = fmt_spread(s.get("x_sum"), "x") if not arm.pool else "1"
                x_warm = fmt_spread(s.get("x_warm"), "x") if not arm.pool else "1"
                x_img = fmt_spread(s.get("x_img"), "x") if not arm.pool else "1"
                fds = f"{s['fds'][0]:.0f}" if s["fds"] else "—"
                lines.append(
                    f"| {label} | {name}{partial} | {tensors} | {fmt_spread(s['next_ms'])} | "
                    f"{fmt_spread(s['drop_ms'])} | {fmt_spread(s['sum_ms'])} | {x_sum} | "
                    f"{fmt_spread(s['warm_sum_ms'])} | {x_warm} | "
                    f"{fmt_spread(s['img_s'])} | {x_img} | {fds} |")
        # the DESIGN.md-style table: added cost per stage, per loader
        lines += ["", f"### {w} workers — added by each stage (next+drop ms, medians)", "",
                  "| what crosses | tensors | DL fd | + stage | DL fs | + stage | Pool | + stage "
                  "| fd ÷ Pool | fs ÷ Pool | fd ÷ Pool warm | fs ÷ Pool warm |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        prev = {}
        for row, label in rows:
            cols = []
            tensors = summary[(w, row, "pool")]["tensors"] or summary[(w, row, "dl_fd")]["tensors"]
            for arm in ARMS:
                s = summary[(w, row, arm.key)]
                if s["sum_ms"] is None:
                    cols += ["FAILED", "—"]
                    prev[arm.key] = None
                    continue
                cur = s["sum_ms"][0]
                delta = "—" if prev.get(arm.key) is None else f"{cur - prev[arm.key]:+.3f}"
                cols += [fmt_num(cur), delta]
                prev[arm.key] = cur
            ratios = []
            for which in ("x_sum", "x_warm"):
                for key in ("dl_fd", "dl_fs"):
                    x = summary[(w, row, key)].get(which)
                    ratios.append(f"{fmt_num(x[0])}x" if x else "—")
            lines.append(f"| {label} | {','.join(map(str, tensors))} | " + " | ".join(cols)
                         + " | " + " | ".join(ratios) + " |")
    notes = []
    for (w, row, arm), s in summary.items():
        if s["not_ready"]:
            notes.append(f"{w}w {row} {arm}: {s['not_ready']} latency samples found the queue "
                         "not full within --max-settle-ms")
        if s["not_freed"]:
            notes.append(f"{w}w {row} {arm}: {s['not_freed']} batches not freed by `del` alone")
        if s["slot_growths_timed"]:
            notes.append(f"{w}w {row} {arm}: {s['slot_growths_timed']} slot growths in timed phases")
    if notes:
        lines += ["", "Notes:"] + [f"* {n}" for n in notes]
    return "\n".join(lines)


def target_checks(summary, workers_list, rows) -> str:
    """The project's targets, evaluated on the medians of this run."""
    lines = ["", "### Targets (medians of this run; p25 = median over reps of each cell's "
             "lower-quartile sample: less affected by preemption on a busy machine)", ""]

    def med(w, row, arm, key):
        s = summary.get((w, row, arm), {}).get(key)
        return s[0] if s else None

    def verdict(ok):
        return "n/a" if ok is None else ("PASS" if ok else "MISS")

    def show(x, unit):
        return "—" if x is None else fmt_num(x) + unit

    for w in workers_list:
        for label, sum_key, x_key in (("next+drop after a sleep", "sum_ms", "x_sum"),
                                      ("warm next+drop", "warm_sum_ms", "x_warm")):
            c = med(w, "packed", "pool", sum_key)
            d = med(w, "per_sample", "pool", sum_key)
            c25 = med(w, "packed", "pool", sum_key.replace("_ms", "_p25_ms"))
            d25 = med(w, "per_sample", "pool", sum_key.replace("_ms", "_p25_ms"))
            xfd = med(w, "per_sample", "dl_fd", x_key)
            xfs = med(w, "per_sample", "dl_fs", x_key)
            lines.append(
                f"* {w} workers, {label}: Pool packed {show(c, ' ms')} (p25 {show(c25, '')}) "
                f"<= 0.1 ms {verdict(None if c is None else c <= 0.1)}; Pool per-sample "
                f"{show(d, ' ms')} (p25 {show(d25, '')}) "
                f"<= 0.4 ms {verdict(None if d is None else d <= 0.4)}; per-sample DL fd ÷ Pool "
                f"{show(xfd, 'x')} >= 70x {verdict(None if xfd is None else xfd >= 70)}; "
                f"DL fs ÷ Pool {show(xfs, 'x')} >= 15x {verdict(None if xfs is None else xfs >= 15)}")
        behind = []
        for row in rows:
            for arm in DL_ARMS:
                s = summary[(w, row, arm.key)]
                x = s.get("x_img")
                if x and x[0] < 1.0:
                    pool_img, dl_img = summary[(w, row, "pool")]["img_s"], s["img_s"]
                    overlap = pool_img and dl_img and pool_img[2] >= dl_img[1]
                    behind.append(f"{row} vs {arm.key} ({fmt_num(x[0])}x"
                                  f"{', ranges overlap' if overlap else ''})")
        lines.append(f"* {w} workers, throughput Pool >= DataLoader in every cell: "
                     f"{'PASS' if not behind else 'MISS: ' + '; '.join(behind)}")
    return "\n".join(lines)


def plot(summary, workers_list, rows, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: --plot skipped (pip install matplotlib)"
    panels = (("sum_ms", "next+drop ms (after a sleep)", True),
              ("warm_sum_ms", "next+drop ms (warm)", True),
              ("img_s", "img/s (free-running)", True))
    fig, axes = plt.subplots(len(panels), len(workers_list), figsize=(6 * len(workers_list), 11),
                             squeeze=False)
    width = 0.8 / len(ARMS)
    for col, w in enumerate(workers_list):
        for r, (key, ylabel, log) in enumerate(panels):
            ax = axes[r][col]
            for k, arm in enumerate(ARMS):
                meds, lo, hi, xs = [], [], [], []
                for i, row in enumerate(rows):
                    s = summary[(w, row, arm.key)][key]
                    if s is None:
                        continue
                    xs.append(i + (k - 1) * width)
                    meds.append(s[0])
                    lo.append(s[0] - s[1])
                    hi.append(s[2] - s[0])
                ax.bar(xs, meds, width, yerr=[lo, hi], capsize=2, label=arm.label)
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels([ROW_LABEL[r] for r in rows], rotation=15, fontsize=8)
            ax.set_ylabel(ylabel)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{w} workers")
            ax.legend(fontsize=7)
    fig.suptitle(f"worker→main hand-off, batch {BATCH}, {RESOLUTION}×{RESOLUTION} "
                 "(median, min–max over reps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot written to {path}"


# ---------------------------------------------------------------------------
# profile

def run_profile(row: str, arm: Arm, workers: int, dataset, cfg, top: int = 25) -> str:
    """cProfile of `next(it); del batch` only (sleeps and polling excluded)."""
    strategy_before = torch_mp.get_sharing_strategy()
    if arm.strategy:
        torch_mp.set_sharing_strategy(arm.strategy)
    warmup, _, _ = cell_batches(workers, cfg)
    loader = make_loader(arm, row, workers, dataset, cfg, warmup + cfg.samples)
    it = iter(loader)
    prof = cProfile.Profile()
    try:
        for _ in range(warmup):
            batch = next(it)
            del batch
        for _ in range(cfg.samples):
            wait_ready(it, cfg.settle_s, cfg.max_settle_s)
            prof.enable()
            batch = next(it)
            del batch
            prof.disable()
        for batch in it:
            del batch
    finally:
        it._shutdown_workers()
        del it, loader
        gc.collect()
        torch_mp.set_sharing_strategy(strategy_before)
        wait_no_children()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    total = stats.total_tt
    buf.write(f"{arm.label}, row {row}, {workers} workers: {cfg.samples} x (next + del), "
              f"{total * 1e3 / cfg.samples:.3f} ms per batch under the profiler\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


# ---------------------------------------------------------------------------
# main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default=None, help='comma-separated worker counts (default "2,4"; '
                   '"2" with --quick)')
    p.add_argument("--reps", type=int, default=3, help="repetitions (>= 3 for a median with range)")
    p.add_argument("--quick", action="store_true", help="short run (< 2 min on 2 cores)")
    p.add_argument("--samples", type=int, default=None, help="timed next()/del pairs per cell (30; quick 8)")
    p.add_argument("--tp-batches", type=int, default=None, help="batches in the throughput pass "
                   "(40; quick 10)")
    p.add_argument("--settle-ms", type=float, default=20.0, help="minimum sleep before a timed next()")
    p.add_argument("--max-settle-ms", type=float, default=5000.0,
                   help="bound on waiting for a full prefetch queue")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="loaders' timeout= in s: a batch lost in a worker (e.g. DataLoader's queue "
                        "feeder hitting the descriptor limit drops it) fails the cell, not the run")
    p.add_argument("--prefetch", type=int, default=2, help="prefetch_factor (DataLoader default 2)")
    p.add_argument("--rows", default=",".join(r for r, _ in ROWS), help="subset of rows")
    p.add_argument("--dataset", choices=("cheap", "jpeg"), default="cheap")
    p.add_argument("--nofile", type=int, default=None,
                   help="set the soft RLIMIT_NOFILE first (1024: the stock limit)")
    p.add_argument("--json", metavar="PATH", help="write raw numbers")
    p.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="also write the tables to a file")
    p.add_argument("--from-json", metavar="PATH",
                   help="re-render the tables (and --plot) from a --json file; runs nothing")
    p.add_argument("--profile", metavar="ROW", help="profile one cell of ROW instead of the ablation")
    p.add_argument("--profile-arm", choices=list(ARM_BY_KEY), default="pool")
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = "2" if args.quick else "2,4"
    args.workers_list = [int(x) for x in args.workers.split(",") if x.strip()]
    if not args.workers_list or min(args.workers_list) < 1:
        p.error(f"--workers needs positive integers, got {args.workers!r}")
    if args.samples is None:
        args.samples = 8 if args.quick else 30
    if args.tp_batches is None:
        args.tp_batches = 10 if args.quick else 40
    args.rows_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in args.rows_list + ([args.profile] if args.profile else []):
        if r not in ROW_LABEL:
            p.error(f"unknown row {r!r}; choose from {', '.join(ROW_LABEL)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    args.settle_s = args.settle_ms / 1e3
    args.max_settle_s = args.max_settle_ms / 1e3
    return args


def header_lines(meta: dict) -> list:
    return [
        f"## poolloader hand-off benchmark (bench/handoff.py{' --quick' if meta['quick'] else ''})",
        "",
        f"batch {BATCH}, {RESOLUTION}×{RESOLUTION}, image f32 + bool mask + 7-field targets "
        f"(n uniform 0..{MAX_INSTANCES}); dataset {meta['dataset']}; packer {meta['packer']}; "
        f"pin_memory=False, prefetch_factor={meta['prefetch']}; {meta['reps']} reps × "
        f"{meta['samples']} (after-sleep, warm) pairs of timed next()/del + {meta['tp_batches']} "
        f"free-running batches per cell; {meta['cpus']} CPUs, torch {meta['torch']}, Python "
        f"{meta['python']}, start method {meta['start_method']}, ulimit -n {meta['nofile'][0]}; "
        f"run took {meta['wall_s']:.0f} s"
        + (f", 1-min load average {meta['loadavg_1min'][0]} at the start and "
           f"{meta['loadavg_1min'][1]} at the end." if "loadavg_1min" in meta else "."),
        "",
        "next = wall time of next() on a batch already done, after sleeping until the prefetch "
        "queue is full (cold caches); warm = the batch right after it, also ready; drop = wall "
        "time of `del batch`; DL ÷ Pool and Pool ÷ DL are per-repetition ratios between arms "
        "run side by side; fds = open descriptors of the main process at the end of the "
        "throughput pass (last batch held).",
    ]


def report(results: list, meta: dict, cfg) -> str:
    """Markdown tables, target checks, cleanup line; writes --markdown and --plot."""
    workers_list = sorted({r["workers"] for r in results}, key=meta["workers"].index)
    rows = [r for r, _ in ROWS if any(c["row"] == r for c in results)]
    summary = summarise(results, workers_list, rows)
    text = markdown(summary, workers_list, rows, header_lines(meta))
    text += "\n" + target_checks(summary, workers_list, rows)
    clean = meta.get("cleanup")
    if clean is not None:
        text += ("\n\nCleanup: live child processes at the end: "
                 f"{clean['children'] or 'none'}; new /dev/shm names: {clean['shm_leaked'] or 'none'}"
                 f"; torch_shm_manager daemons started by the file_system arm (they exit with "
                 f"this process): {clean['new_shm_managers'] or 'none'}.")
    if cfg.plot:
        text += "\n\n" + plot(summary, workers_list, rows, cfg.plot)
    if cfg.markdown:
        with open(cfg.markdown, "w") as f:
            f.write(text + "\n")
    return text, summary


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.from_json:
        with open(cfg.from_json) as f:
            payload = json.load(f)
        meta = dict(payload["environment"], cleanup=payload.get("cleanup"))
        print(report(payload["cells"], meta, cfg)[0])
        return 0
    if cfg.nofile is not None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(cfg.nofile, hard), hard))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    shm_before = shm_names()
    managers_before = set(shm_manager_pids())
    per_cell = cell_batches(max(cfg.workers_list), cfg)[2]
    tmpdir = tempfile.mkdtemp(prefix="poolloader-handoff-")
    load_start = os.getloadavg()[0]
    t_start = time.perf_counter()
    try:
        dataset, dataset_desc = build_dataset(cfg.dataset, per_cell * BATCH, tmpdir)
        if cfg.profile:
            print(run_profile(cfg.profile, ARM_BY_KEY[cfg.profile_arm], cfg.workers_list[0],
                              dataset, cfg))
            return 0
        rows = [r for r, _ in ROWS if r in cfg.rows_list]
        results = []
        n_cells = cfg.reps * len(cfg.workers_list) * len(rows) * len(ARMS)
        done = 0
        for rep in range(cfg.reps):
            for w in cfg.workers_list:
                for row in rows:
                    k = (rep + rows.index(row)) % len(ARMS)
                    for arm in ARMS[k:] + ARMS[:k]:  # rotated per rep: no arm always first
                        with StderrCapture(tmpdir) as captured:
                            res = run_cell(arm, row, w, dataset, cfg)
                        if not res["ok"] and captured.cause():
                            res["error"] += f" (worker stderr: {captured.cause()})"
                        res["rep"] = rep
                        results.append(res)
                        done += 1
                        status = (f"next+drop {res['sum_ms']:.3f} ms, {res['img_s']:.0f} img/s"
                                  if res["ok"] else f"FAILED: {res['error']}")
                        print(f"[{done}/{n_cells} {time.perf_counter() - t_start:6.1f}s] rep {rep} "
                              f"{w}w {row:<10} {arm.key}: {status}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - t_start
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)

    # Hygiene: no child left, no new /dev/shm name (give unlinks a moment).
    children = wait_no_children()
    deadline = time.monotonic() + 5.0
    while True:
        leaked = sorted(n for n in shm_names() - shm_before if ours(n))
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    cleanup = {"children": {str(k): v for k, v in children.items()}, "shm_leaked": leaked,
               "new_shm_managers": sorted(set(shm_manager_pids()) - managers_before)}
    meta = {"quick": cfg.quick, "workers": cfg.workers_list, "reps": cfg.reps,
            "samples": cfg.samples, "tp_batches": cfg.tp_batches, "prefetch": cfg.prefetch,
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "nofile": list(nofile),
            "start_method": torch_mp.get_start_method(), "dataset": dataset_desc,
            "packer": PACKER, "wall_s": wall,
            "loadavg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    text, summary = report(results, dict(meta, cleanup=cleanup), cfg)
    print(text)
    if cfg.json:
        payload = {
            "config": {k: v for k, v in vars(cfg).items()},
            "environment": meta,
            "cells": results,
            "summary": [{"workers": w, "row": row, "arm": arm, **s}
                        for (w, row, arm), s in summary.items()],
            "cleanup": cleanup,
        }
        with open(cfg.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 1 if (children or leaked) else 0


if __name__ == "__main__":
    sys.exit(main())
