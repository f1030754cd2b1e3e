"""The consumer keeps every batch: `list(loader)`, torch DataLoader vs PoolLoader.

A DataLoader batch is ordinary memory the user owns; a training script that
collects an epoch (evaluation, caching, debugging) does `batches = list(loader)`,
or keeps only the small part it needs (the targets, for a metric). This measures
what that costs the main process and how much shared memory stays held.

Data: bench/workload.py's RF-DETR-shaped data set (`RFDETRShaped`: per sample an
image f32 [3,R,R], a bool mask [R,R] and RF-DETR's 7 target tensors, n uniform
in 0..14) collated by `RFDETRCollate(row)` into batches of 16: images + mask +
targets as 16 dicts of 7 tensors ("per_sample", 114 tensors) or packed one
tensor per field ("packed", 10 tensors). R is `--resolution`, 320 by default
(21 MiB per batch: 100 kept batches hold 2.1 GiB per arm; 576, RF-DETR's, holds
6.9 GiB), so the bench fits a shared machine.

Cells: row × what is kept:
  all      `kept = list(it)`: every batch, whole;
  targets  `kept = [batch[2] for batch in it]`: only the targets of each batch
           (the small tensors), the images and mask dropped at once.

Arms: `DataLoader` (default sharing strategy, file_descriptor on Linux) and
`PoolLoader` with the same arguments (`--workers`, prefetch_factor 2,
pin_memory off, timeout `--timeout`). PoolLoader runs with its defaults: a
consumer that keeps every batch makes it detach the oldest held slot's segment
for each new request (the batch keeps it, the pool gets a fresh one), which is
what "all" measures.

Method, per measurement (cell × arm), via bench/common.py's interleave:
create the loader and `iter()` it (worker start and pool creation untimed),
then take the epoch of `--batches` batches as above, timed: main-process CPU
time (all threads, /proc schedstat) over the loop, per batch; the epoch's end
(the last `next()` shuts the workers down) is inside it, as in a real
`list(loader)`. With the batches (or targets) still held after the epoch:
  shm held   bytes of /dev/shm objects the main process maps
             (`procs.shm_mapped_bytes`: unlinked ones included, each counted once);
  kept       bytes of the tensors the consumer holds (what it asked to keep);
  fds        the main process's open descriptors (and its RSS, in the JSON).
Then everything is dropped, `gc.collect()`, and the shared memory still mapped
is recorded (`shm_after_mib`, JSON only: should be 0). Repetitions interleave
the arms in rotated order; median [min–max] over repetitions and PoolLoader /
DataLoader ratios paired per repetition. A failed measurement (PoolExhausted,
"Too many open files" with DataLoader's one descriptor per kept tensor under a
low `ulimit -n`) is reported as FAILED with its error.

Usage:
    python bench/keep.py [--quick] [--batches 100] [--rows per_sample,packed]
                         [--resolution 320] [--workers 2] [--out DIR] [--reps N]
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import procs  # noqa: E402
import workload  # noqa: E402
import writers  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from poolloader import PoolLoader  # noqa: E402

NAME = "keep"
PREFETCH = 2
ARMS = ("DataLoader", "PoolLoader")
LOADERS = {"DataLoader": DataLoader, "PoolLoader": PoolLoader}
KEEPS = ("all", "targets")
ROWS = ("per_sample", "packed")
METRICS = ("main_cpu_ms", "shm_mib", "kept_mib", "fds", "rss_mib", "shm_after_mib", "batch_s")


def pool_options(args) -> dict:
    """PoolLoader's own options: none (its defaults; held batches are detached)."""
    return {}


def kept_part(batch, keep: str):
    return batch if keep == "all" else batch[2]


def measure(cell, arm: str, args) -> dict:
    row, keep = cell
    pool = arm == "PoolLoader"
    dataset = workload.RFDETRShaped(args.batches * workload.BATCH, resolution=args.resolution)
    options = dict(batch_size=workload.BATCH, num_workers=args.workers, prefetch_factor=PREFETCH,
                   collate_fn=workload.RFDETRCollate(row, pool), timeout=args.timeout)
    if pool:
        options.update(pool_options(args))
    loader = LOADERS[arm](dataset, **options)
    it = iter(loader)
    procs.note_workers(it)
    kept = None
    try:
        main0, t0 = procs.cpu_ns(os.getpid()), time.perf_counter()
        kept = [kept_part(batch, keep) for batch in it]
        wall, main = time.perf_counter() - t0, procs.cpu_ns(os.getpid()) - main0
        if len(kept) != args.batches:
            raise common.BenchError(f"got {len(kept)} batches, expected {args.batches}")
        held = {"shm_mib": procs.shm_mapped_bytes() / 2**20,
                "kept_mib": sum(t.nbytes for t in workload.tensors_in(kept)) / 2**20,
                "fds": procs.fd_count(), "rss_mib": procs.rss_bytes() / 2**20}
        stats = loader.stats.as_dict() if pool else {}
    finally:
        kept = None
        workload.shutdown_iterator(it)
        del it, loader
        left = procs.wait_clean()
    if left:
        raise common.BenchError(f"left behind after the measurement: {left}")
    out = {"main_cpu_ms": main / 1e6 / args.batches, "batch_s": args.batches / wall, **held,
           "shm_after_mib": procs.shm_mapped_bytes() / 2**20}
    out.update({f"pool_{k}": v for k, v in stats.items()
                if k in ("slot_count", "pool_growths", "slot_growths", "pool_bytes")})
    return out


def median_text(raw, cell, arm, metric, spec) -> str:
    s = common.summarize(raw.series(cell, arm, metric))
    return common.fmt_num(s.median, spec) if s.n else "–"


def kept_text(raw, cell) -> str:
    """The kept bytes (the same data for both arms: one number, or both when they differ)."""
    values = {arm: common.summarize(raw.series(cell, arm, "kept_mib")) for arm in ARMS}
    shown = {arm: common.fmt_num(s.median, ".1f") for arm, s in values.items() if s.n}
    if len(set(shown.values())) <= 1:
        return next(iter(shown.values()), "–")
    return " / ".join(f"{arm} {v}" for arm, v in shown.items())


def render(raw, args) -> str:
    rows = []
    for cell in raw.cells:
        row, keep = cell
        rows.append([
            row, keep,
            common.cell_text(raw, cell, "DataLoader", "main_cpu_ms", ".2f"),
            common.cell_text(raw, cell, "PoolLoader", "main_cpu_ms", ".2f"),
            common.ratio_text(raw, cell, "PoolLoader", "DataLoader", "main_cpu_ms"),
            common.cell_text(raw, cell, "DataLoader", "shm_mib", ".0f"),
            common.cell_text(raw, cell, "PoolLoader", "shm_mib", ".0f"),
            common.ratio_text(raw, cell, "PoolLoader", "DataLoader", "shm_mib"),
            kept_text(raw, cell),
            " / ".join(median_text(raw, cell, arm, "fds", ".0f") for arm in ARMS),
        ])
    knob = pool_options(args)
    head = (f"The consumer keeps every batch: {args.batches} batches of {workload.BATCH} × "
            f"{args.resolution}² RF-DETR-shaped samples per epoch, {args.workers} workers, "
            f"prefetch_factor {PREFETCH}; PoolLoader "
            f"{'max_slots=' + str(knob['max_slots']) if knob else 'with its defaults'}; "
            f"{args.reps} repetitions (+{args.warmup_reps} warm-up), median [min–max]; ratios "
            f"paired per repetition. main ms = main-process CPU time of the epoch per batch; "
            f"shm held = /dev/shm bytes the main process maps after the epoch with the kept "
            f"data alive; kept = bytes of the kept tensors. {writers.env_line()}.")
    table = writers.markdown_table(
        ["targets", "kept", "DataLoader main ms", "PoolLoader main ms", "Pool/DL main ms",
         "DataLoader shm held MiB", "PoolLoader shm held MiB", "Pool/DL shm", "kept MiB",
         "fds DL / Pool (median)"], rows, "llrrrrrrrr")
    return f"### {NAME}\n\n{head}\n\n{table}\n"


def plot(raw, args):
    groups = [f"{row}, keep {keep}" for row, keep in raw.cells]
    return writers.plot_bars(
        args.plot, groups,
        {arm: [common.summarize(raw.series(c, arm, "main_cpu_ms")) for c in raw.cells]
         for arm in ARMS},
        ylabel="main-process CPU ms per batch", title=f"keep every batch: {args.batches} "
        f"batches, {args.resolution}², {args.workers} workers")


def main(argv=None) -> None:
    p = common.parser(NAME, __doc__)
    p.add_argument("--batches", type=int, default=None, help="batches per epoch (100; quick 50)")
    p.add_argument("--rows", default=None,
                   help="comma-separated: per_sample, packed (default both; quick per_sample)")
    p.add_argument("--keep", default=",".join(KEEPS), help="comma-separated: all, targets")
    p.add_argument("--resolution", type=int, default=320, help="image side (576 is RF-DETR's)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="loaders' timeout= in s")
    args = common.parse(p, argv)
    args.batches = args.batches or (50 if args.quick else 100)
    rows = (args.rows or ("per_sample" if args.quick else ",".join(ROWS))).split(",")
    keeps = args.keep.split(",")
    for value, allowed in ((rows, ROWS), (keeps, KEEPS)):
        bad = sorted(set(value) - set(allowed))
        if bad:
            p.error(f"unknown {bad}; choose from {list(allowed)}")

    cells = [(row, keep) for row in rows for keep in keeps]
    raw = common.interleave(
        cells, ARMS, lambda cell, arm, rep: measure(cell, arm, args),
        reps=args.reps, warmup_reps=args.warmup_reps, label=NAME,
        show=lambda m: (f"{m['main_cpu_ms']:.2f} main ms/batch, shm held {m['shm_mib']:.0f} MiB, "
                        f"kept {m['kept_mib']:.1f} MiB, {m['fds']} fds"))
    writers.write_outputs(args, render(raw, args), {
        "raw": raw.as_json(), "pool_options": pool_options(args),
        "summary": common.summaries(raw, METRICS, baseline="DataLoader")})
    if args.plot:
        plot(raw, args)


if __name__ == "__main__":
    main()
