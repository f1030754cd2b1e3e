"""Where a batch's cost goes, stage by stage: the main thread's budget per batch
(wait, decode, small-block copy, refill, resume record, CUDA gate) and a worker's
(read request, fetch, collate, encode, capture), for PoolLoader with and without
pin_memory and without resume capture, beside DataLoader's total, in one run.

Data: the RF-DETR shape of bench/handoff.py (`workload.RFDETRShaped`, batch 16,
576x576), rows `packed` (images, mask, targets packed one tensor per field) and
`per_sample` (the 16 target dicts as they are: 114 tensors).

Arms (same data, same collate as bench/handoff.py):
  dl           DataLoader, file_descriptor sharing: next()+del total only
  pool         PoolLoader, pin_memory=False
  pool_nostate PoolLoader, pin_memory=False, stateful=False (no resume capture)
  pool_pin     PoolLoader, pin_memory=True, CUDA played by the stand-in of
               tests/cuda_standin.py (these machines have no GPU): the gate's
               CUDA calls are counted, not timed as a GPU would take them. A
               "training step" is queued on a side stream after every batch and
               run one batch later, so each release finds a busy stream.

Method, per cell (workers x row x arm), per repetition: build the loader (fork
workers), pull 2 x (workers x prefetch + 2) + 2 warm-up batches, then twice
`--samples` timed `next(); del` pairs, each after sleeping until the prefetch
queue is full (bench/handoff.py's `wait_ready`, so "wait" is the pop of a ready
reply, not a worker's time):
  1. plain: wall time of next() + del: the figure to compare with DataLoader;
  2. staged: the same with timers wrapped around each stage's function in main
     (exclusive times: a stage's callees are counted in their own stage), so
     the stages show where the time goes; the wrappers add about 1 µs per call,
     so this total is above the plain one. Each stage's figure is its median over
     the pairs (a preempted pair does not move it); "other" is the staged
     total's median minus the stages': torch's __next__, the reorder buffer, the
     lease's release, the timers themselves.
  Stage functions: wait = PoolLoaderIter._wait_returned; decode = codec.decode;
  small copy = codec.copy_small; refill = PoolLoaderIter._refill; resume =
  _reply_record + ResumeTracker.received/commit; gate = SlotGate release/ready/
  wait_any/pin.
  Workers time their own stages (installed by worker_init_fn, exclusive times,
  summed in shared memory): read request = slot_format.read_request; fetch =
  the fetcher's fetch() minus the collate; collate = the collate_fn; encode =
  codec.encode + slot_format.write_state; capture = WorkerProgress.capture. Per
  batch over the batches served during the staged phase.
  CUDA calls per batch (pool_pin): calls on the stand-in during the staged phase
  divided by its batches.
Table: median [min-max] over repetitions, µs per batch. On a shared 2-core
machine absolute times are noisy: compare within a run.

`--fixed-cost` measures instead the fixed cost of a ready batch (issue 47 item 2),
DataLoader (file_descriptor) beside PoolLoader, `--workers` (default 2) workers,
fork, in one run:
  rows  none    a dict of Python ints, no tensor (`workload.IntsCollate`)
        count   the batch size as a 1-element tensor (bench/handoff.py's row a)
        packed  images, mask, targets packed one tensor per field (10 tensors)
  floor torch's cost to make one tensor view over memory it does not own:
        `torch.frombuffer(buffer, dtype, count, offset).view(shape)` + del, the
        main thread's CPU time per view, median of 20 blocks of 200 views.
        "in the loop": the same view, 10 made right after each sample's three
        batches (the caches and the other core as those batches met them: a
        worker writing a refill); PoolLoader's packed cell.
        "after a sleep": 10 such views made first thing after the same sleep
        as a cold batch meets it, in `--samples` samples of their own (each
        followed by three untimed batches); PoolLoader's packed cell.
  Per cell and repetition: the warm-up of the other mode, then `--samples` times:
  sleep until the prefetch queue is full (`wait_ready`), then time three ready
  batches back to back: main-thread CPU time (`time.thread_time_ns`) and wall time
  of `next(); del`. "cold" is the first after the sleep, "warm" the median of the
  other two. A figure is the median over the samples; the table shows median
  [min-max] over repetitions, and the ratios are per repetition between the loaders
  run side by side. Targets: none: Pool <= DataLoader; packed: Pool <= 1.25 x
  (DataLoader's none + 10 x floor), all in CPU time; the report also sets warm
  packed against DataLoader's none + 10 x the floor in the loop, and cold packed
  against DataLoader's cold none + the 10 views after a sleep.

Usage:
  python bench/stages.py [--quick] [--workers 2,4] [--rows packed,per_sample]
                         [--samples 30] [--reps 3] [--out DIR] [--json PATH]
  python bench/stages.py --fixed-cost [--reps 5] [--samples 30] [--workers 2]
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import platform
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import common  # noqa: E402
import procs  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402
import writers  # noqa: E402
from handoff import wait_ready  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data._utils import fetch as torch_fetch  # noqa: E402
from workload import BATCH  # noqa: E402

from poolloader import PoolLoader  # noqa: E402
from poolloader.cuda import gate as cuda
from poolloader.main.iterator import PoolLoaderIter  # noqa: E402
from poolloader.resume import keys as resume
from poolloader.resume.tracker import ResumeTracker  # noqa: E402
from poolloader.wire import codec
from poolloader.wire import slot_format as fmt  # noqa: E402

NAME = "stages"
ARMS = ["dl", "pool", "pool_nostate", "pool_pin"]
ARM_LABEL = {"dl": "DataLoader", "pool": "PoolLoader", "pool_nostate": "PoolLoader stateful=False",
             "pool_pin": "PoolLoader pin_memory (stand-in)"}
MAIN_STAGES = ["wait", "decode", "small_copy", "refill", "resume", "gate"]
WORKER_STAGES = ["read_request", "fetch", "collate", "encode", "capture"]


# ---------------------------------------------------------------------------
# timers: exclusive time per stage (a stage's callees are charged to their own)

class StageClock:
    def __init__(self, stages):
        self.index = {s: i for i, s in enumerate(stages)}
        self.total = [0] * len(stages)
        self.stack: list[list[int]] = []  # per open call: [start ns, ns spent in callees]
        self.on = True
        self.restore: list[tuple] = []

    def wrap(self, owner, name: str, stage: str) -> None:
        original = getattr(owner, name)
        i = self.index[stage]

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            frame = [time.perf_counter_ns(), 0]
            self.stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.perf_counter_ns() - frame[0]
                self.total[i] += spent - frame[1]
                if self.stack:
                    self.stack[-1][1] += spent

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(owner, name, timed)
        self.restore.append((owner, name, original))

    def unwrap(self) -> None:
        for owner, name, original in reversed(self.restore):
            setattr(owner, name, original)
        self.restore = []


MAIN = StageClock(MAIN_STAGES)


def install_main_clock() -> None:
    MAIN.wrap(PoolLoaderIter, "_wait_returned", "wait")
    MAIN.wrap(codec, "decode", "decode")
    MAIN.wrap(codec, "copy_small", "small_copy")
    MAIN.wrap(PoolLoaderIter, "_refill", "refill")
    MAIN.wrap(PoolLoaderIter, "_reply_record", "resume")
    MAIN.wrap(ResumeTracker, "received", "resume")
    MAIN.wrap(ResumeTracker, "commit", "resume")
    for name in ("release", "ready", "wait_any", "pin"):
        MAIN.wrap(cuda.SlotGate, name, "gate")


class WorkerClocks:
    """Worker-side stage totals in shared memory: per worker, one ns total per stage
    and the batches served. Installed in each (forked) worker by `init`."""

    def __init__(self, workers: int):
        self.width = len(WORKER_STAGES) + 1
        self.shared = multiprocessing.RawArray("d", workers * self.width)

    def init(self, worker_id: int) -> None:
        clock = StageClock(WORKER_STAGES)
        row = worker_id * self.width
        shared, n = self.shared, len(WORKER_STAGES)
        clock.wrap(fmt, "read_request", "read_request")
        clock.wrap(torch_fetch._MapDatasetFetcher, "fetch", "fetch")
        clock.wrap(codec, "encode", "encode")
        clock.wrap(fmt, "write_state", "encode")
        clock.wrap(resume.WorkerProgress, "capture", "capture")
        fetch = torch_fetch._MapDatasetFetcher.fetch

        def fetch_and_publish(fetcher, index):
            try:
                return fetch(fetcher, index)
            finally:  # publish the totals so far (the previous batch's encode included)
                for i in range(n):
                    shared[row + i] = clock.total[i]
                shared[row + n] += 1

        torch_fetch._MapDatasetFetcher.fetch = fetch_and_publish
        CLOCKS_IN_WORKER.append(clock)

    def snapshot(self) -> list[float]:
        return list(self.shared)

    def per_batch(self, before, after) -> dict:
        n = len(WORKER_STAGES)
        totals = [0.0] * n
        batches = 0.0
        for w in range(len(after) // self.width):
            row = w * self.width
            batches += after[row + n] - before[row + n]
            for i in range(n):
                totals[i] += after[row + i] - before[row + i]
        if batches <= 1:
            return {}
        return {f"w_{s}_us": totals[i] / batches / 1e3 for i, s in enumerate(WORKER_STAGES)}


CLOCKS_IN_WORKER: list[StageClock] = []


class TimedCollate:
    """The row's collate, timed in the worker (the "collate" stage)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, samples):
        clocks = CLOCKS_IN_WORKER
        if not clocks:
            return self.inner(samples)
        clock = clocks[0]
        frame = [time.perf_counter_ns(), 0]
        clock.stack.append(frame)
        try:
            return self.inner(samples)
        finally:
            clock.stack.pop()
            spent = time.perf_counter_ns() - frame[0]
            clock.total[clock.index["collate"]] += spent - frame[1]
            if clock.stack:
                clock.stack[-1][1] += spent


# ---------------------------------------------------------------------------
# one cell

def make_loader(arm: str, row: str, workers: int, dataset, batches: int, cfg, clocks):
    kw = dict(batch_size=BATCH, num_workers=workers, sampler=range(batches * BATCH),
              drop_last=True, prefetch_factor=cfg.prefetch, timeout=60,
              multiprocessing_context="fork")
    if arm == "dl":
        return DataLoader(dataset, collate_fn=workload.RFDETRCollate(row, False), **kw), None
    kw.update(collate_fn=TimedCollate(workload.RFDETRCollate(row, True)), worker_init_fn=clocks.init)
    if arm == "pool_nostate":
        return PoolLoader(dataset, stateful=False, **kw), None
    if arm == "pool_pin":
        from cuda_standin import SimCuda
        sim = SimCuda()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DataLoader's: no accelerator here
            loader = PoolLoader(dataset, pin_memory=True, **kw)
        loader._cuda_runtime = sim
        return loader, sim
    return PoolLoader(dataset, **kw), None


def timed_pairs(it, cfg, sim, side, staged: bool) -> tuple[list[float], list[list[float]]]:
    """(next+del µs per pair, the main stages' µs per pair when `staged`)."""
    out, stages = [], []
    for _ in range(cfg.samples):
        if sim is not None:
            sim.run(side)  # the GPU caught up with the previous step
        wait_ready(it, cfg.settle_s, cfg.max_settle_s)
        before = list(MAIN.total)
        MAIN.on = staged
        t0 = time.perf_counter_ns()
        batch = next(it)
        del batch
        t1 = time.perf_counter_ns()
        MAIN.on = False
        if sim is not None:
            sim.work(side, "step")  # queued after the batch: its release finds it busy
        out.append((t1 - t0) / 1e3)
        stages.append([(a - b) / 1e3 for a, b in zip(MAIN.total, before)])
    return out, stages


def run_cell(arm: str, row: str, workers: int, dataset, cfg) -> dict:
    in_flight = workers * cfg.prefetch
    warmup = 2 * (in_flight + 2) + 2
    total = warmup + 2 * cfg.samples + in_flight + 2
    clocks = WorkerClocks(workers)
    loader, sim = make_loader(arm, row, workers, dataset, total, cfg, clocks)
    it = iter(loader)
    res: dict = {}
    try:
        procs.note_workers(it)
        side = sim.stream(0, "training") if sim is not None else None
        for _ in range(warmup):
            batch = next(it)
            del batch
        plain, _ = timed_pairs(it, cfg, sim, side, staged=False)
        res["total_us"] = statistics.median(plain)
        if arm != "dl":
            calls0 = len(sim.calls) if sim is not None else 0
            before = clocks.snapshot()
            staged, per_stage = timed_pairs(it, cfg, sim, side, staged=True)
            after = clocks.snapshot()
            n = len(staged)
            res["staged_total_us"] = statistics.median(staged)
            for i, stage in enumerate(MAIN_STAGES):  # medians over the pairs: preemption is rare
                res[f"{stage}_us"] = statistics.median(p[i] for p in per_stage)
            res["other_us"] = res["staged_total_us"] - sum(res[f"{s}_us"] for s in MAIN_STAGES)
            res.update(clocks.per_batch(before, after))
            if sim is not None:
                res["cuda_calls"] = (len(sim.calls) - calls0) / n
        for batch in it:
            del batch
    finally:
        batch = None  # noqa: F841
        it._shutdown_workers()
        del it, loader
        gc.collect()
        procs.wait_no_children()
    return res


# ---------------------------------------------------------------------------
# --fixed-cost: a ready batch's fixed cost beside DataLoader's and torch's one view

FIXED_ROWS = ["none", "count", "packed"]
FIXED_ARMS = ["dl", "pool"]
LOOP_VIEWS = 10  # views timed right after each sample's batches (the floor in the loop)


def one_view_us() -> float:
    """Main-thread CPU µs for torch to make (and drop) one small tensor view over a
    buffer it does not own: the per-tensor floor."""
    buffer = bytearray(1 << 16)
    blocks = []
    for _ in range(20):
        c0 = time.thread_time_ns()
        for k in range(200):
            t = torch.frombuffer(buffer, dtype=torch.float32, count=64, offset=256 * k).view(16, 4)
            del t
        blocks.append((time.thread_time_ns() - c0) / 200 / 1e3)
    return statistics.median(blocks)


def fixed_collate(row: str, pool: bool):
    return workload.IntsCollate() if row == "none" else workload.RFDETRCollate(row, pool)


def fixed_batches(workers: int, cfg) -> tuple[int, int]:
    """(warm-up batches, batches in all) of one --fixed-cost cell: each sample takes
    3 batches after a sleep, and each sample of the floor after a sleep 3 more."""
    in_flight = workers * cfg.prefetch
    warmup = 2 * (in_flight + 2) + 2
    return warmup, warmup + 2 * 3 * cfg.samples + in_flight + 2


def views_after_sleep(view_buffer) -> tuple[float, float]:
    """Main-thread CPU µs of torch's first view, and of LOOP_VIEWS views, made as the
    first thing after a sleep (what a cold next() meets)."""
    c0 = time.thread_time_ns()
    t = torch.frombuffer(view_buffer, dtype=torch.float32, count=64, offset=0).view(16, 4)
    del t
    c1 = time.thread_time_ns()
    for k in range(1, LOOP_VIEWS):
        t = torch.frombuffer(view_buffer, dtype=torch.float32, count=64, offset=256 * k).view(16, 4)
        del t
    return (c1 - c0) / 1e3, (time.thread_time_ns() - c0) / 1e3


def run_fixed(arm: str, row: str, workers: int, dataset, cfg) -> dict:
    warmup, total = fixed_batches(workers, cfg)
    cls = DataLoader if arm == "dl" else PoolLoader
    loader = cls(dataset, batch_size=BATCH, num_workers=workers, sampler=range(total * BATCH),
                 drop_last=True, prefetch_factor=cfg.prefetch, timeout=60,
                 multiprocessing_context="fork", collate_fn=fixed_collate(row, arm != "dl"))
    it = iter(loader)
    cold_cpu, warm_cpu, cold_wall, warm_wall, loop_view = [], [], [], [], []
    view_buffer = bytearray(256 * LOOP_VIEWS)
    try:
        procs.note_workers(it)
        for _ in range(warmup):
            batch = next(it)
            del batch
        for _ in range(cfg.samples):
            wait_ready(it, cfg.settle_s, cfg.max_settle_s)
            cpu, wall = [], []
            for _ in range(3):
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                batch = next(it)
                del batch
                c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
                cpu.append((c1 - c0) / 1e3)
                wall.append((t1 - t0) / 1e3)
            cold_cpu.append(cpu[0])
            cold_wall.append(wall[0])
            # torch's one view right after those batches: the same caches, the same
            # worker writing the refills on the other core as the warm batches met
            c0 = time.thread_time_ns()
            for k in range(LOOP_VIEWS):
                t = torch.frombuffer(view_buffer, dtype=torch.float32, count=64,
                                     offset=256 * k).view(16, 4)
                del t
            loop_view.append((time.thread_time_ns() - c0) / LOOP_VIEWS / 1e3)
            warm_cpu.append(statistics.median(cpu[1:]))
            warm_wall.append(statistics.median(wall[1:]))
        # torch's views after the same sleep, in samples of their own (a view made
        # before a timed next() would warm the code that next() meets cold)
        first_view, cold_views = [], []
        for _ in range(cfg.samples):
            wait_ready(it, cfg.settle_s, cfg.max_settle_s)
            first, views = views_after_sleep(view_buffer)
            first_view.append(first)
            cold_views.append(views)
            for _ in range(3):
                batch = next(it)
                del batch
        for batch in it:
            del batch
    finally:
        batch = None  # noqa: F841
        it._shutdown_workers()
        del it, loader
        gc.collect()
        procs.wait_no_children()
    return {"cold_cpu_us": statistics.median(cold_cpu), "warm_cpu_us": statistics.median(warm_cpu),
            "cold_wall_us": statistics.median(cold_wall), "warm_wall_us": statistics.median(warm_wall),
            "view_us": one_view_us(), "loop_view_us": statistics.median(loop_view),
            "cold_first_view_us": statistics.median(first_view),
            "cold_views_us": statistics.median(cold_views)}


def fixed_report(raw: common.Raw, workers_list, cfg, load, wall_s) -> str:
    lines = ["## fixed cost of a ready batch (bench/stages.py --fixed-cost)", "",
             f"batch {BATCH}, RF-DETR shape, cheap dataset, fork, prefetch_factor={cfg.prefetch}; "
             f"{cfg.reps} reps × {cfg.samples} samples of 3 ready batches; {os.cpu_count()} CPUs, "
             f"torch {torch.__version__}, Python {platform.python_version()}; 1-min load average "
             f"{load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; run took {wall_s:.0f} s.",
             "", "µs per batch of `next(); del`, median [min–max] over reps; cpu = main thread's "
             "CPU time, wall = wall time; cold = first after a sleep, warm = the next ones; "
             "Pool ÷ DL per repetition."]
    for w in workers_list:
        lines += ["", f"### {w} workers", "",
                  "| row | metric | DataLoader | PoolLoader | Pool ÷ DL |", "|---|---|---:|---:|---:|"]
        for row in FIXED_ROWS:
            cell = (w, row)
            for key in ("cold_cpu_us", "warm_cpu_us", "cold_wall_us", "warm_wall_us"):
                dl, pool = raw.series(cell, "dl", key), raw.series(cell, "pool", key)
                ratio = common.summarize(p / d for d, p in zip(dl, pool) if d and p)
                lines.append(f"| {row} | {key[:-3].replace('_', ' ')} | "
                             f"{common.cell_text(raw, cell, 'dl', key)} | "
                             f"{common.cell_text(raw, cell, 'pool', key)} | {ratio.fmt('.2f', '×')} |")
        views = [v for row in FIXED_ROWS for arm in FIXED_ARMS
                 for v in raw.series((w, row), arm, "view_us")]
        floor = common.summarize(views)
        # the same view made right after the packed batches, in PoolLoader's loop
        in_loop = common.summarize(raw.series((w, "packed"), "pool", "loop_view_us"))
        lines += ["", f"torch's one view (floor per tensor): {floor.fmt('.2f')} µs CPU alone; "
                  f"{in_loop.fmt('.2f')} µs right after PoolLoader's packed batches, in its loop "
                  "(the caches and the other core as those batches met them).", ""]
        for key in ("cold_cpu_us", "warm_cpu_us"):
            none_dl = common.summarize(raw.series((w, "none"), "dl", key)).median
            none_pool = common.summarize(raw.series((w, "none"), "pool", key)).median
            packed_pool = common.summarize(raw.series((w, "packed"), "pool", key)).median
            bound = 1.25 * (none_dl + 10 * floor.median)
            lines.append(
                f"* {key[:-3].replace('_', ' ')}: none: Pool {none_pool:.1f} vs DataLoader "
                f"{none_dl:.1f} µs ({'met' if none_pool <= none_dl else 'MISSED'}, "
                f"{none_pool / none_dl:.2f}×); packed: Pool {packed_pool:.1f} vs 1.25 × "
                f"({none_dl:.1f} + 10 × {floor.median:.2f}) = {bound:.1f} µs "
                f"({'met' if packed_pool <= bound else 'MISSED'}, {packed_pool / bound * 1.25:.2f}× "
                "the floor)")
        packed_pool = common.summarize(raw.series((w, "packed"), "pool", "warm_cpu_us")).median
        none_dl = common.summarize(raw.series((w, "none"), "dl", "warm_cpu_us")).median
        bound = none_dl + 10 * in_loop.median
        lines.append(f"* warm cpu, packed against the floor in the loop: Pool {packed_pool:.1f} vs "
                     f"{none_dl:.1f} + 10 × {in_loop.median:.2f} = {bound:.1f} µs "
                     f"({packed_pool / bound:.2f}× that floor)")
        # the cold verdict's floor as a cold next() meets it: torch's ten views made
        # first thing after the same sleep (the cell's own; PoolLoader's packed one)
        cold_views = common.summarize(raw.series((w, "packed"), "pool", "cold_views_us"))
        first = common.summarize(raw.series((w, "packed"), "pool", "cold_first_view_us"))
        packed_pool = common.summarize(raw.series((w, "packed"), "pool", "cold_cpu_us")).median
        none_dl = common.summarize(raw.series((w, "none"), "dl", "cold_cpu_us")).median
        bound = none_dl + cold_views.median
        lines.append(f"* cold cpu, packed against the floor after a sleep: Pool {packed_pool:.1f} vs "
                     f"{none_dl:.1f} + {cold_views.median:.1f} (torch's {LOOP_VIEWS} views made first "
                     f"thing after the sleep; the first alone {first.median:.1f}) = {bound:.1f} µs "
                     f"({packed_pool / bound:.2f}× that floor)")
    return "\n".join(lines)


def main_fixed(cfg) -> int:
    workers_list = [int(x) for x in (cfg.workers or "2").split(",")]
    per_cell = fixed_batches(max(workers_list), cfg)[1]
    dataset = workload.RFDETRShaped(per_cell * BATCH)
    cells = [(w, row) for w in workers_list for row in FIXED_ROWS]
    t0, load = time.perf_counter(), os.getloadavg()[0]
    raw = common.interleave(cells, FIXED_ARMS,
                            lambda cell, arm, rep: run_fixed(arm, cell[1], cell[0], dataset, cfg),
                            reps=cfg.reps, warmup_reps=cfg.warmup_reps, label=NAME + " fixed-cost",
                            stagger=True, show=lambda m: f"cold cpu {m['cold_cpu_us']:.0f} µs, "
                            f"warm cpu {m['warm_cpu_us']:.0f} µs")
    text = fixed_report(raw, workers_list, cfg, load, time.perf_counter() - t0)
    writers.write_outputs(cfg, text, {"raw": raw.as_json(), "workers": workers_list,
                                      "samples": cfg.samples, "mode": "fixed-cost"})
    return 0 if not procs.wait_no_children() else 1


# ---------------------------------------------------------------------------
# report

def table(raw: common.Raw, workers_list, rows) -> str:
    lines = []
    for w in workers_list:
        lines += ["", f"### {w} workers — main thread, µs per batch (median [min–max] over reps)", "",
                  "| what crosses | loader | next+del | staged total | wait | decode | small copy "
                  "| refill | resume record | gate | other | CUDA calls/batch |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in rows:
            cell = (w, row)
            for arm in ARMS:
                if not raw.ok(cell, arm):
                    err = "; ".join(sorted(set(raw.errors[cell][arm]))) or "no result"
                    lines.append(f"| {row} | {ARM_LABEL[arm]} | FAILED: {err} |" + " |" * 9)
                    continue
                cols = [common.cell_text(raw, cell, arm, "total_us")]
                keys = ["staged_total_us"] + [f"{s}_us" for s in MAIN_STAGES] + ["other_us", "cuda_calls"]
                for key in keys:
                    cols.append(common.cell_text(raw, cell, arm, key) if raw.series(cell, arm, key) else "—")
                lines.append(f"| {row} | {ARM_LABEL[arm]} | " + " | ".join(cols) + " |")
        lines += ["", f"### {w} workers — a worker, µs per batch (median [min–max] over reps)", "",
                  "| what crosses | loader | read request | fetch | collate | encode | capture |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for row in rows:
            cell = (w, row)
            for arm in ARMS[1:]:
                if not raw.ok(cell, arm):
                    continue
                cols = [common.cell_text(raw, cell, arm, f"w_{s}_us")
                        if raw.series(cell, arm, f"w_{s}_us") else "—" for s in WORKER_STAGES]
                lines.append(f"| {row} | {ARM_LABEL[arm]} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = common.parser(NAME, __doc__, reps=(3, 2), warmup_reps=(0, 0))
    p.add_argument("--workers", default=None, help='comma-separated worker counts (default "2,4"; quick "2")')
    p.add_argument("--rows", default="packed,per_sample", help="rows of bench/handoff.py")
    p.add_argument("--samples", type=int, default=None, help="timed pairs per phase (30; quick 10)")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--settle-ms", type=float, default=20.0)
    p.add_argument("--max-settle-ms", type=float, default=5000.0)
    p.add_argument("--fixed-cost", action="store_true",
                   help="the fixed cost of a ready batch (rows none, count, packed) instead")
    args = common.parse(p, argv)
    args.workers_list = [int(x) for x in (args.workers or ("2" if args.quick else "2,4")).split(",")]
    args.rows_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in args.rows_list:
        if r not in workload.ROW_LABEL:
            p.error(f"unknown row {r!r}; choose from {', '.join(workload.ROW_LABEL)}")
    args.samples = args.samples or (10 if args.quick else 30)
    args.settle_s, args.max_settle_s = args.settle_ms / 1e3, args.max_settle_ms / 1e3
    return args


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.fixed_cost:
        return main_fixed(cfg)
    in_flight = max(cfg.workers_list) * cfg.prefetch
    per_cell = 2 * (in_flight + 2) + 2 + 2 * cfg.samples + in_flight + 2
    dataset = workload.RFDETRShaped(per_cell * BATCH)
    install_main_clock()
    MAIN.on = False
    cells = [(w, row) for w in cfg.workers_list for row in cfg.rows_list]
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    raw = common.interleave(cells, ARMS, lambda cell, arm, rep: run_cell(arm, cell[1], cell[0], dataset, cfg),
                            reps=cfg.reps, warmup_reps=cfg.warmup_reps, label=NAME, stagger=True,
                            show=lambda m: f"next+del {m['total_us']:.0f} µs")
    MAIN.unwrap()
    header = [f"## per-stage cost of a batch (bench/stages.py{' --quick' if cfg.quick else ''})", "",
              f"batch {BATCH}, {workload.RESOLUTION}×{workload.RESOLUTION}, RF-DETR shape, cheap "
              f"dataset; prefetch_factor={cfg.prefetch}; {cfg.reps} reps × {cfg.samples} timed "
              f"next()+del per phase after a full prefetch queue; {os.cpu_count()} CPUs, torch "
              f"{torch.__version__}, Python {platform.python_version()}; 1-min load average "
              f"{load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; run took "
              f"{time.perf_counter() - t0:.0f} s.",
              "", "next+del: plain wall time (compare loaders with it); the stages come from a "
              "second, instrumented phase (its total is above the plain one by the timers' cost)."]
    text = "\n".join(header) + "\n" + table(raw, cfg.workers_list, cfg.rows_list)
    writers.write_outputs(cfg, text, {"raw": raw.as_json(), "workers": cfg.workers_list,
                                      "rows": cfg.rows_list, "samples": cfg.samples})
    return 0 if not procs.wait_no_children() else 1


if __name__ == "__main__":
    sys.exit(main())
