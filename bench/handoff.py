"""Headline benchmark: what a batch costs the main process when it crosses the
worker -> main boundary, for torch's DataLoader (both sharing strategies) and
PoolLoader, side by side in one run.

It reproduces the ablation of RF-DETR PR #1399 (docs/benchmarks.md, "Hand-off:
the headline run") on the RF-DETR detection shape: batch 16, 576x576; per sample an image
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
  (Data set and collate: `workload.RFDETRShaped`, `workload.RFDETRCollate`.)

Dataset: `--dataset cheap` (default) returns precomputed tensors (the image is
returned as is, the 7 target tensors are cloned, as a real dataset builds them
fresh), so workers are not the bottleneck and the boundary is what is measured.
`--dataset jpeg` decodes real JPEGs: `fixtures.synthetic.CocoLikeDataset(576)`
over 32 cached `make_coco_like` images (640x480), plus an all-False mask.

Method, per cell (workers x row x arm), per repetition:
  1. Create the loader over a range sampler of exactly the batches the cell
     uses (plus one prefetch depth), `iter()` it, pull and drop warm-up batches
     (2 x (workers x prefetch + 2) + 2: every PoolLoader slot has grown by then;
     slot growths during the timed phases are recorded and should be 0).
  2. Latency phase, `--samples` times: wait until the prefetch queue is full
     (sleep `--settle-ms`, then poll every 1 ms until every outstanding batch is
     done: DataLoader `_data_queue.qsize() >= _tasks_outstanding`, PoolLoader
     `it.prefetched`: replies waiting >= requests in flight; bounded by --max-settle-ms), then
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
  4. fds = open descriptors of the main process at the end of the throughput
     pass (`procs.fd_count`), iterator alive and the last batch still held
     (also the peak during the latency phase and the baseline before the
     loader, in the JSON).
  5. Drain the rest of the epoch (so no batch is left in a queue: the
     file_system strategy would otherwise leave its names in /dev/shm until
     this process exits), shut the workers down, restore the sharing strategy,
     collect garbage, wait (<= 10 s) until no child process is left.
  Per cell and repetition the statistic is the median over the samples; the
  table shows the median [min-max] of those over `--reps` repetitions. Within a
  repetition the three arms of one (workers, row) run back to back, in an order
  rotated from one repetition (and row) to the next (`common.interleave` with
  `stagger`). Ratios (DataLoader / PoolLoader next+drop, PoolLoader / DataLoader
  img/s) are computed per repetition between arms measured side by side, then
  summarised the same way. On a shared 2-core machine absolute times are noise;
  the ratios are the figures. At the end the run checks that no child process
  and no /dev/shm name of its own (pl2-<this pid>-*, torch_<worker pid>_*) is
  left, and exits 1 if one is.

A cell that fails is reported as FAILED with its error and the run goes on.
Loaders get `timeout=--timeout` (60 s): DataLoader's worker-side failure at a
low descriptor limit ("Too many open files" in the result queue's feeder
thread) drops the batch and would otherwise hang the main process; the cell's
stderr is captured so the failure names that cause. Main-side failures
("received 0 items of ancdata") raise directly. `--nofile N` sets the soft
descriptor limit first (1024 reproduces the stock limit of the seed's crash).

The report says where its figures come from (the command, the machine, what each row
carries and what each figure means), then per worker count a summary table (the
README's layout) and the detailed tables. `--targets` adds the project's targets
(docs/benchmarks.md), evaluated on this run's medians.

`--profile ROW` runs one cell of `--profile-arm` (default pool) under cProfile,
timing only next() + del after a sleep, and prints the top entries instead of
the ablation. `--from-json PATH` re-renders the tables (and `--plot`) from a
previous `--json` file.

Usage:
  python bench/handoff.py [--quick] [--workers 2,4] [--reps 3]
                          [--dataset cheap|jpeg] [--out DIR] [--json PATH]
                          [--plot PATH] [--markdown PATH] [--nofile N]
                          [--timeout S] [--targets] [--profile per_sample]
                          [--from-json PATH]
"""
from __future__ import annotations

import cProfile
import gc
import io
import json
import os
import platform
import pstats
import resource
import shlex
import statistics
import sys
import tempfile
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import procs  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402
import workload  # noqa: E402
import writers  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from workload import BATCH, RESOLUTION, ROW_LABEL, ROWS  # noqa: E402

from poolloader import PoolLoader  # noqa: E402

NAME = "handoff"
MAX_INSTANCES = workload.MAX_INSTANCES
PACKER = "poolloader.detection.pack_targets"


class Arm:
    def __init__(self, key, label, loader_cls, strategy, options=None):
        self.key, self.label, self.loader_cls, self.strategy = key, label, loader_cls, strategy
        self.options = options or {}  # extra PoolLoader keywords

    @property
    def pool(self) -> bool:
        return self.loader_cls is PoolLoader


ARMS = [
    Arm("dl_fd", "DataLoader file_descriptor", DataLoader, "file_descriptor"),
    Arm("dl_fs", "DataLoader file_system", DataLoader, "file_system"),
    Arm("pool", "PoolLoader", PoolLoader, None),  # its default backend: memfd
    Arm("pool_posix", "PoolLoader posix", PoolLoader, None, {"shm_backend": "posix"}),
]
ARM_BY_KEY = {a.key: a for a in ARMS}
DL_ARMS = [a for a in ARMS if not a.pool]
STAGE_ARMS = [ARM_BY_KEY[k] for k in ("dl_fd", "dl_fs", "pool")]


# ---------------------------------------------------------------------------
# data

class CocoLikeWithMask:
    """`fixtures.synthetic.CocoLikeDataset` items plus a padding mask (all False:
    every image is resized to the same square), cycled to `length` items."""

    def __init__(self, base, length: int):
        self.base, self.length = base, length
        self.mask = torch.zeros(RESOLUTION, RESOLUTION, dtype=torch.bool)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        image, target = self.base[index % len(self.base)]
        return image, self.mask, target


def build_dataset(kind: str, length: int):
    """(dataset, description)."""
    if kind == "cheap":
        return (workload.RFDETRShaped(length),
                "cheap: precomputed tensors (targets cloned per item)")
    from fixtures.synthetic import CocoLikeDataset

    root, ann = workload.coco_like_data(32, seed=0)
    return (CocoLikeWithMask(CocoLikeDataset(root, ann, resolution=RESOLUTION), length),
            "jpeg: fixtures.synthetic.make_coco_like(32 images 640x480) + CocoLikeDataset(576)")


# ---------------------------------------------------------------------------
# one cell

def all_ready(it):
    """True when every outstanding batch of `it` is done and waiting for main;
    None when the iterator's internals are not what this bench expects."""
    try:
        if hasattr(it, "prefetched"):  # PoolLoader
            waiting, in_flight = it.prefetched
            return waiting >= in_flight
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


def make_loader(arm: Arm, row: str, workers: int, dataset, cfg, batches: int):
    """`batches` batches of the first items (a range sampler: the cell can drain its epoch)."""
    kwargs = dict(batch_size=BATCH, num_workers=workers,
                  collate_fn=workload.RFDETRCollate(row, arm.pool), sampler=range(batches * BATCH),
                  pin_memory=False, drop_last=True, prefetch_factor=cfg.prefetch,
                  timeout=cfg.timeout, **arm.options)
    return arm.loader_cls(dataset, **kwargs)


def cell_batches(workers: int, cfg) -> tuple[int, int, int]:
    """(warm-up, throughput warm-up, total batches the cell's sampler yields)."""
    in_flight = workers * cfg.prefetch
    warmup = 2 * (in_flight + 2) + 2
    tp_warmup = in_flight + 2
    total = warmup + 2 * cfg.samples + tp_warmup + cfg.tp_batches + in_flight
    return warmup, tp_warmup, total


def run_cell(arm: Arm, row: str, workers: int, dataset, cfg) -> dict:
    """One measurement of (arm, row, workers): the metrics of the method in the
    module docstring. Raises on failure, after shutting everything down."""
    res = {}
    strategy_before = torch_mp.get_sharing_strategy()
    warmup, tp_warmup, total = cell_batches(workers, cfg)
    pair = workers * cfg.prefetch >= 2  # a full queue holds a second ready batch
    loader = it = batch = None
    try:
        if arm.strategy:
            torch_mp.set_sharing_strategy(arm.strategy)
        res["fds_baseline"] = procs.fd_count()
        loader = make_loader(arm, row, workers, dataset, cfg, total)
        it = iter(loader)
        procs.note_workers(it)
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
                found = workload.tensors_in(batch)
                res["tensors"] = len(found)
                probes = (weakref.ref(found[0]), weakref.ref(found[-1]))
                del found
                fds_peak = max(fds_peak, procs.fd_count())
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
        res["fds"] = procs.fd_count()  # end of the pass: iterator alive, last batch held
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
            "next_ms": statistics.median(nexts[i] for i in use),
            "drop_ms": statistics.median(drops),
            "sum_ms": statistics.median(nexts[i] + drops[i] for i in use),
            "sum_p25_ms": common.quantile([nexts[i] + drops[i] for i in use], 0.25),
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
                "warm_sum_p25_ms": common.quantile([a + b for a, b in zip(wn, wd)], 0.25),
                "samples_warm_next_ms": [round(x, 4) for x in wn],
                "samples_warm_drop_ms": [round(x, 4) for x in wd],
            })
    finally:
        batch = None  # noqa: F841 (drop the last batch before the workers stop)
        shutdown_error = None
        if it is not None:
            try:
                it._shutdown_workers()
            except Exception as exc:
                shutdown_error = common.error_text(exc)
        del it, loader
        gc.collect()
        torch_mp.set_sharing_strategy(strategy_before)
        left = procs.wait_no_children()
    if shutdown_error:
        res["shutdown_error"] = shutdown_error
    if left:
        res["leftover_children"] = {str(k): v for k, v in left.items()}
    return res


def measure(cell, arm_key: str, dataset, cfg, capture_dir: str) -> dict:
    """`run_cell` with the cell's stderr captured: a failure names the worker's error."""
    workers, row = cell
    with StderrCapture(capture_dir) as captured:
        try:
            return run_cell(ARM_BY_KEY[arm_key], row, workers, dataset, cfg)
        except Exception as exc:
            error = common.error_text(exc)
    cause = captured.cause()
    raise common.BenchError(error + (f" (worker stderr: {cause})" if cause else ""))


def progress(res: dict) -> str:
    return f"next+drop {res['sum_ms']:.3f} ms, {res['img_s']:.0f} img/s"


# ---------------------------------------------------------------------------
# summaries

def summarise(raw: common.Raw) -> dict:
    """{(workers, row, arm): {metric: Summary, ...}} with per-rep paired ratios."""
    out = {}
    for cell in raw.cells:
        w, row = cell
        for arm in ARMS:
            k = arm.key
            n_ok = raw.ok(cell, k)
            s = {"n_ok": n_ok, "n": n_ok + len(raw.errors[cell][k]),
                 "errors": sorted(set(raw.errors[cell][k]))}
            for key in ("next_ms", "drop_ms", "sum_ms", "sum_p25_ms", "warm_next_ms",
                        "warm_drop_ms", "warm_sum_ms", "warm_sum_p25_ms", "img_s", "fds",
                        "fds_peak"):
                s[key] = common.summarize(raw.series(cell, k, key))
            s["tensors"] = sorted(set(raw.series(cell, k, "tensors")))
            s["not_ready"] = sum(raw.series(cell, k, "not_ready"))
            s["not_freed"] = sum(raw.series(cell, k, "not_freed_by_del"))
            s["slot_growths_timed"] = sum(raw.series(cell, k, "slot_growths_timed"))
            if k == "pool_posix":  # the two backends, side by side
                s["x_backend"] = common.ratio(raw, cell, k, "pool", "sum_ms")
                s["x_backend_warm"] = common.ratio(raw, cell, k, "pool", "warm_sum_ms")
            if not arm.pool:
                s["x_sum"] = common.ratio(raw, cell, k, "pool", "sum_ms")
                s["x_warm"] = common.ratio(raw, cell, k, "pool", "warm_sum_ms")
                s["x_img"] = common.ratio(raw, cell, "pool", k, "img_s")
            out[(w, row, k)] = s
    return out


def fmt(s: common.Summary, unit: str = "") -> str:
    return s.fmt("auto", unit) if s.n else "—"


def med(s: common.Summary | None):
    return s.median if s is not None and s.n else None


def markdown(summary, workers_list, rows, header) -> str:
    lines = list(header)
    rows = [(r, ROW_LABEL[r]) for r in rows]
    short = {"dl_fd": "DataLoader fd", "dl_fs": "DataLoader fs", "pool": "PoolLoader",
             "pool_posix": "PoolLoader posix"}
    for w in workers_list:
        lines += ["", f"### {w} workers — details: main-process cost per batch, median [min–max] "
                  "over reps", "",
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
                x_sum = fmt(s["x_sum"], "×") if not arm.pool else "1"
                x_warm = fmt(s["x_warm"], "×") if not arm.pool else "1"
                x_img = fmt(s["x_img"], "×") if not arm.pool else "1"
                fds = f"{s['fds'].median:.0f}" if s["fds"].n else "—"
                lines.append(
                    f"| {label} | {name}{partial} | {tensors} | {fmt(s['next_ms'])} | "
                    f"{fmt(s['drop_ms'])} | {fmt(s['sum_ms'])} | {x_sum} | "
                    f"{fmt(s['warm_sum_ms'])} | {x_warm} | {fmt(s['img_s'])} | {x_img} | {fds} |")
        # the ablation-style table: added cost per stage, per loader
        lines += ["", f"### {w} workers — added by each stage (next+drop ms, medians)", "",
                  "| what crosses | tensors | DL fd | + stage | DL fs | + stage | Pool | + stage "
                  "| fd ÷ Pool | fs ÷ Pool | fd ÷ Pool warm | fs ÷ Pool warm |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        prev = {}
        for row, label in rows:
            cols = []
            tensors = summary[(w, row, "pool")]["tensors"] or summary[(w, row, "dl_fd")]["tensors"]
            for arm in STAGE_ARMS:
                cur = med(summary[(w, row, arm.key)]["sum_ms"])
                if cur is None:
                    cols += ["FAILED", "—"]
                    prev[arm.key] = None
                    continue
                delta = "—" if prev.get(arm.key) is None else f"{cur - prev[arm.key]:+.3f}"
                cols += [common.fmt_num(cur), delta]
                prev[arm.key] = cur
            ratios = []
            for which in ("x_sum", "x_warm"):
                for key in ("dl_fd", "dl_fs"):
                    x = med(summary[(w, row, key)].get(which))
                    ratios.append(f"{common.fmt_num(x)}×" if x is not None else "—")
            lines.append(f"| {label} | {','.join(map(str, tensors))} | " + " | ".join(cols)
                         + " | " + " | ".join(ratios) + " |")
        # the shared-memory backends: memfd (the default) against POSIX /dev/shm
        lines += ["", f"### {w} workers — shared-memory backends (next+drop ms, median [min–max])", "",
                  "| what crosses | memfd (default) | posix | posix ÷ memfd | posix ÷ memfd (warm) |",
                  "|---|---:|---:|---:|---:|"]
        for row, label in rows:
            memfd_s, posix_s = summary[(w, row, "pool")], summary[(w, row, "pool_posix")]
            lines.append(f"| {label} | {fmt(memfd_s['sum_ms'])} | {fmt(posix_s['sum_ms'])} | "
                         f"{fmt(posix_s['x_backend'], '×')} | {fmt(posix_s['x_backend_warm'], '×')} |")
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

    def get(w, row, arm, key):
        return med(summary.get((w, row, arm), {}).get(key))

    def verdict(ok):
        return "n/a" if ok is None else ("PASS" if ok else "MISS")

    def show(x, unit):
        return "—" if x is None else common.fmt_num(x) + unit

    for w in workers_list:
        for label, sum_key, x_key in (("next+drop after a sleep", "sum_ms", "x_sum"),
                                      ("warm next+drop", "warm_sum_ms", "x_warm")):
            c = get(w, "packed", "pool", sum_key)
            d = get(w, "per_sample", "pool", sum_key)
            c25 = get(w, "packed", "pool", sum_key.replace("_ms", "_p25_ms"))
            d25 = get(w, "per_sample", "pool", sum_key.replace("_ms", "_p25_ms"))
            xfd = get(w, "per_sample", "dl_fd", x_key)
            xfs = get(w, "per_sample", "dl_fs", x_key)
            lines.append(
                f"* {w} workers, {label}: Pool packed {show(c, ' ms')} (p25 {show(c25, '')}) "
                f"<= 0.1 ms {verdict(None if c is None else c <= 0.1)}; Pool per-sample "
                f"{show(d, ' ms')} (p25 {show(d25, '')}) "
                f"<= 0.4 ms {verdict(None if d is None else d <= 0.4)}; per-sample DL fd ÷ Pool "
                f"{show(xfd, '×')} >= 70× {verdict(None if xfd is None else xfd >= 70)}; "
                f"DL fs ÷ Pool {show(xfs, '×')} >= 15× {verdict(None if xfs is None else xfs >= 15)}")
        behind = []
        for row in rows:
            for arm in DL_ARMS:
                x = summary[(w, row, arm.key)].get("x_img")
                if x is not None and x.n and x.median < 1.0:
                    pool_img, dl_img = summary[(w, row, "pool")]["img_s"], summary[(w, row, arm.key)]["img_s"]
                    overlap = pool_img.n and dl_img.n and pool_img.max >= dl_img.min
                    behind.append(f"{row} vs {arm.key} ({common.fmt_num(x.median)}×"
                                  f"{', ranges overlap' if overlap else ''})")
        lines.append(f"* {w} workers, throughput Pool >= DataLoader in every cell: "
                     f"{'PASS' if not behind else 'MISS: ' + '; '.join(behind)}")
    return "\n".join(lines)


def plot(summary, workers_list, rows, path: str) -> str:
    plt = writers.pyplot()
    if plt is None:
        return "matplotlib is not installed: --plot skipped (pip install matplotlib)"
    panels = (("sum_ms", "next+drop ms (after a sleep)"), ("warm_sum_ms", "next+drop ms (warm)"),
              ("img_s", "img/s (free-running)"))
    fig, axes = plt.subplots(len(panels), len(workers_list), figsize=(6 * len(workers_list), 11),
                             squeeze=False)
    for col, w in enumerate(workers_list):
        for r, (key, ylabel) in enumerate(panels):
            writers.draw_bars(axes[r][col], [ROW_LABEL[row] for row in rows],
                              {arm.label: [summary[(w, row, arm.key)][key] for row in rows]
                               for arm in ARMS},
                              ylabel=ylabel, title=f"{w} workers", log=True, rotation=15)
    fig.suptitle(f"worker→main hand-off, batch {BATCH}, {RESOLUTION}×{RESOLUTION} "
                 "(median, min–max over reps)")
    writers.save_figure(fig, plt, path)
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
        procs.wait_no_children()
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
    p = common.parser(NAME, __doc__, reps=(3, 3), warmup_reps=(0, 0))
    p.add_argument("--workers", default=None, help='comma-separated worker counts (default "2,4"; '
                   '"2" with --quick)')
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
    p.add_argument("--from-json", metavar="PATH",
                   help="re-render the tables (and --plot) from a --json file; runs nothing")
    p.add_argument("--targets", action="store_true",
                   help="also check the project's targets on this run's medians (docs/benchmarks.md)")
    p.add_argument("--profile", metavar="ROW", help="profile one cell of ROW instead of the ablation")
    p.add_argument("--profile-arm", choices=list(ARM_BY_KEY), default="pool")
    args = common.parse(p, argv)
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
    args.settle_s = args.settle_ms / 1e3
    args.max_settle_s = args.max_settle_ms / 1e3
    return args


ROW_MEANING = {
    "count": "the batch size alone, as a 1-element tensor",
    "image_mask": f"images [{BATCH},3,{RESOLUTION},{RESOLUTION}] float32 + padding masks "
                  f"[{BATCH},{RESOLUTION},{RESOLUTION}] bool",
    "packed": "(b) + the targets packed one tensor per field (`pack_targets`)",
    "per_sample": f"(b) + the {BATCH} target dicts of 7 tensors each, as they are "
                  "(RF-DETR's default)",
}


def machine() -> str:
    """CPUs (model), OS and memory of this machine, and its GPU (which the run does not use)."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        memory = f", {kib / 2**20:.0f} GiB memory"
    except (OSError, StopIteration, ValueError):
        memory = ""
    gpu = (f"GPU {torch.cuda.get_device_name(0)} (not used: the hand-off is CPU-side)"
           if torch.cuda.is_available() else "no GPU")
    return (f"{os.cpu_count()} CPUs{f' ({model})' if model else ''}{memory}, "
            f"{platform.system()} {platform.release()}, {gpu}")


def header_lines(meta: dict, rows) -> list:
    """Where the figures come from: the command, the machine, the batch, what each row
    and each figure means."""
    command = meta.get("command") or f"python bench/handoff.py{' --quick' if meta['quick'] else ''}"
    load = (f"; 1-min load average {meta['loadavg_1min'][0]} at the start, "
            f"{meta['loadavg_1min'][1]} at the end" if "loadavg_1min" in meta else "")
    workers = meta.get("workers")
    where = meta.get("machine") or f"{meta['cpus']} CPUs"
    lines = [
        "## poolloader hand-off benchmark",
        "",
        "What a batch costs the training process when it crosses from a worker: torch's "
        "DataLoader (both sharing strategies) and PoolLoader, run side by side on the same data.",
        "",
        f"* Command: `{command}`",
        f"* Machine: {where}; Python "
        f"{meta['python']}, torch {meta['torch']}, start method {meta['start_method']}, ulimit -n "
        f"{meta['nofile'][0]}{load}; the run took {meta['wall_s']:.0f} s.",
        f"* Batch: {BATCH} samples of {RESOLUTION}×{RESOLUTION} (image, mask, 7 target fields with "
        f"n uniform 0..{MAX_INSTANCES} boxes); dataset {meta['dataset']}; "
        + (f"{', '.join(map(str, workers))} workers, " if workers else "")
        + f"pin_memory=False, prefetch_factor={meta['prefetch']}.",
        f"* Repetitions: {meta['reps']}, each of {meta['samples']} timed batches after a sleep "
        f"(and the one right after each) + {meta['tp_batches']} free-running batches per loader "
        "and row; a figure is the median [min–max] over the repetitions.",
        "",
        "Rows (only the collate's output changes):",
        "",
    ]
    lines += [f"* {ROW_LABEL[row]}: {ROW_MEANING[row]}" for row in rows]
    lines += [
        "",
        "Figures: ms = main-process wall time of `next()` (next) plus `del batch` (drop) on a "
        "batch already waiting, after a sleep that lets the workers fill the queue (cold "
        "caches); warm = the batch right after it; fd ÷ Pool, fs ÷ Pool (DL ÷ Pool) = "
        "DataLoader's ms divided by PoolLoader's, per repetition between loaders run side by "
        "side (on a busy machine the ratios, not the absolute times, are the figures); img/s = "
        "free-running throughput; fds = open descriptors of the main process. Method: this "
        "script's docstring.",
    ]
    return lines


def summary_table(summary, w: int, rows) -> list:
    """The README's table: one line per row, the three loaders and their ratios."""
    lines = ["", f"### {w} workers — summary (ms per batch, next() + del after a sleep)", "",
             "| what crosses | tensors | DataLoader fd | DataLoader file_system | PoolLoader "
             "| fd ÷ Pool | fs ÷ Pool | warm: Pool, fd ÷ Pool | img/s fd / fs / Pool "
             "| fds fd / fs / Pool |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def num(x, unit=""):
        return "—" if x is None else common.fmt_num(x) + unit

    for row in rows:
        fd, fs, pool = (summary[(w, row, key)] for key in ("dl_fd", "dl_fs", "pool"))
        tensors = ",".join(map(str, pool["tensors"] or fd["tensors"])) or "—"
        img = " / ".join(f"{s['img_s'].median:.0f}" if s["img_s"].n else "—" for s in (fd, fs, pool))
        fds = " / ".join(f"{s['fds'].median:.0f}" if s["fds"].n else "—" for s in (fd, fs, pool))
        lines.append(
            f"| {ROW_LABEL[row]} | {tensors} | {num(med(fd['sum_ms']))} | {num(med(fs['sum_ms']))} "
            f"| {fmt(pool['sum_ms'])} | {num(med(fd['x_sum']), '×')} | {num(med(fs['x_sum']), '×')} "
            f"| {num(med(pool['warm_sum_ms']))}, {num(med(fd['x_warm']), '×')} | {img} | {fds} |")
    return lines


def report(raw: common.Raw, meta: dict, cfg) -> tuple[str, dict]:
    """Where the figures come from, the summary and detailed tables, the cleanup line
    (and with --targets the project's targets); writes --plot."""
    workers_list = list(dict.fromkeys(w for w, _ in raw.cells))
    rows = list(dict.fromkeys(row for _, row in raw.cells))
    summary = summarise(raw)
    header = header_lines(meta, rows)
    for w in workers_list:
        header += summary_table(summary, w, rows)
    text = markdown(summary, workers_list, rows, header)
    if cfg.targets:
        text += "\n" + target_checks(summary, workers_list, rows)
    clean = meta.get("cleanup")
    if clean is not None:
        text += ("\n\nCleanup: live child processes at the end: "
                 f"{clean['children'] or 'none'}; new /dev/shm names: {clean['shm_leaked'] or 'none'}"
                 f"; torch_shm_manager daemons started by the file_system arm (they exit with "
                 f"this process): {clean['new_shm_managers'] or 'none'}.")
    if cfg.plot:
        text += "\n\n" + plot(summary, workers_list, rows, cfg.plot)
    return text, summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_args(argv)
    if cfg.from_json:
        with open(cfg.from_json) as f:
            payload = json.load(f)
        print(report(common.Raw.from_json(payload["raw"]),
                     dict(payload["meta"], cleanup=payload.get("cleanup")), cfg)[0])
        return 0
    if cfg.nofile is not None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(cfg.nofile, hard), hard))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    shm_before = procs.shm_names()
    managers_before = set(procs.pids_running("torch_shm_manager"))
    per_cell = cell_batches(max(cfg.workers_list), cfg)[2]
    load_start = os.getloadavg()[0]
    t_start = time.perf_counter()
    dataset, dataset_desc = build_dataset(cfg.dataset, per_cell * BATCH)
    if cfg.profile:
        print(run_profile(cfg.profile, ARM_BY_KEY[cfg.profile_arm], cfg.workers_list[0],
                          dataset, cfg))
        return 0
    rows = [r for r, _ in ROWS if r in cfg.rows_list]
    cells = [(w, row) for w in cfg.workers_list for row in rows]
    with tempfile.TemporaryDirectory(prefix="poolloader-handoff-") as capture_dir:
        raw = common.interleave(
            cells, [a.key for a in ARMS],
            lambda cell, arm, rep: measure(cell, arm, dataset, cfg, capture_dir),
            reps=cfg.reps, warmup_reps=cfg.warmup_reps, label=NAME, stagger=True, show=progress)
    wall = time.perf_counter() - t_start

    # Hygiene: no child left, no new /dev/shm name (give unlinks a moment).
    children = procs.wait_no_children()
    deadline = time.monotonic() + 5.0
    while True:
        leaked = procs.names_of(procs.OUR_PIDS, procs.shm_names() - shm_before)
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    cleanup = {"children": {str(k): v for k, v in children.items()}, "shm_leaked": leaked,
               "new_shm_managers": sorted(set(procs.pids_running("torch_shm_manager"))
                                          - managers_before)}
    meta = {"quick": cfg.quick, "workers": cfg.workers_list, "reps": cfg.reps,
            "samples": cfg.samples, "tp_batches": cfg.tp_batches, "prefetch": cfg.prefetch,
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "nofile": list(nofile),
            "start_method": torch_mp.get_start_method(), "dataset": dataset_desc,
            "packer": PACKER, "wall_s": wall, "machine": machine(),
            "command": shlex.join(["python", "bench/handoff.py", *argv]),
            "loadavg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    text, summary = report(raw, dict(meta, cleanup=cleanup), cfg)
    writers.write_outputs(cfg, text, {
        "meta": meta, "raw": raw.as_json(), "cleanup": cleanup,
        "summary": [{"workers": w, "row": row, "arm": arm,
                     **{k: (v.as_dict() if isinstance(v, common.Summary) else v)
                        for k, v in s.items()}}
                    for (w, row, arm), s in summary.items()]})
    return 1 if (children or leaked) else 0


if __name__ == "__main__":
    sys.exit(main())
