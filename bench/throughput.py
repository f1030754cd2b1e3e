"""Batches per second with cached samples: DataLoader, PoolLoader, and PoolLoader at
an earlier revision, side by side in one run.

The question it answers: with workers that only stack 16 RF-DETR-shaped samples
into the batch (`workload.RFDETRShaped`, 576x576, targets cloned per sample) and a
consumer that does `next()` then `del`, how many batches per second does each
loader deliver, and did a change of this tree make the workers slower than an
earlier revision relative to DataLoader measured in the same run?

Arms (same data, same collate: `workload.RFDETRCollate`, rows `packed` and
`per_sample` of bench/handoff.py):
  dl       DataLoader (file_descriptor sharing, torch's default on Linux)
  pool     PoolLoader, this tree
  nostate  PoolLoader, this tree, stateful=False (no resume capture in workers)
  base     PoolLoader at `--baseline` (default 383d9e4: the code before ownership and
           exact resume, the first parent of e8f5bc9 "Ownership: ..."), in a worktree
           built for it (`revisions.baseline_tree`); `--baseline ''` leaves it out

Method, per cell (workers x row), per repetition: every arm runs in its own
fresh interpreter (so the baseline imports its own tree; the child checks which
poolloader it imported), one after the other, the order rotated per repetition
and cell (`common.interleave`). In the child: build the loader (fork workers),
draw and drop `workers x 2 + 4` batches (worker start, the slots' growth), then
time `next(); del` until `--seconds` have passed and at least `--min-batches`
were drawn. After shutting the loader down, the child waits (at most 10 s) for
its workers to exit and for the /dev/shm names that appeared during the arm with
its pid or a worker's in them to go; an arm that leaves either counts as failed.
Reported per arm: batches/s over the timed window, the workers' and the main
process's CPU ms per batch (/proc schedstat); ratios are per repetition between
arms that ran seconds apart (paired), then median [min–max].

On a 2-core machine the workers of this bench are memory-bound (the stack
into the slot is most of their time: see docs/benchmarks.md "Stage by stage")
and the machine's state moves batches/s by tens of percent between runs:
compare the ratios inside one run, not against a figure from another day.

Usage:
    python bench/throughput.py [--quick] [--workers 2,4] [--rows packed,per_sample]
                               [--seconds 4] [--resolution 576] [--baseline REV]
                               [--out DIR]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

NAME = "throughput"
ARMS = ("dl", "pool", "nostate", "base")
ARM_LABEL = {"dl": "DataLoader", "pool": "PoolLoader", "nostate": "PoolLoader stateful=False",
             "base": "PoolLoader at baseline"}
DEFAULT_BASELINE = "383d9e4"
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def child(spec: dict) -> None:
    """One arm in this fresh interpreter: prints one JSON line of results."""
    sys.path.insert(0, os.path.dirname(HERE))
    import procs
    import revisions  # (through common) puts ROOT first on sys.path: the tree goes in front of it
    import workload
    revisions.use_tree(spec["tree"])
    import torch  # noqa: F401  (imported before the clock starts)
    from torch.utils.data import DataLoader

    import poolloader

    revisions.check_tree(poolloader, spec["tree"])
    arm, row, workers = spec["arm"], spec["row"], spec["workers"]
    pool = arm != "dl"
    # lazy: an item is built when asked for
    dataset = workload.RFDETRShaped(workload.BATCH * 1_000_000, resolution=spec["resolution"])
    kwargs = dict(batch_size=workload.BATCH, num_workers=workers,
                  collate_fn=workload.RFDETRCollate(row, pool))
    if arm == "nostate":
        kwargs["stateful"] = False
    names0 = procs.shm_names()
    loader = (poolloader.PoolLoader if pool else DataLoader)(dataset, **kwargs)
    it = iter(loader)
    try:
        for _ in range(workers * 2 + 4):
            batch = next(it)
            del batch
        pids = procs.note_workers(it)
        main0, workers0 = procs.cpu_ns(os.getpid()), sum(procs.cpu_ns(p) for p in pids)
        start = time.perf_counter()
        n = 0
        while n < spec["min_batches"] or time.perf_counter() - start < spec["seconds"]:
            batch = next(it)
            del batch
            n += 1
        wall = time.perf_counter() - start
        main_ns = procs.cpu_ns(os.getpid()) - main0
        workers_ns = sum(procs.cpu_ns(p) for p in pids) - workers0
    finally:
        workload.shutdown_iterator(it)
        del it
    # what this arm left (children, /dev/shm names with its pid or a worker's): bounded wait
    left = revisions.arm_leftovers(names0, pids)
    print(json.dumps({"batch_s": n / wall, "batches": n, "worker_cpu_ms": workers_ns / 1e6 / n,
                      "main_cpu_ms": main_ns / 1e6 / n, "left": left}))


def table(raw, cfg) -> str:
    import common
    arms = [a for a in ARMS if a in cfg.arms]
    lines = ["| workers | what crosses | loader | batches/s | worker CPU ms/batch | "
             "main CPU ms/batch | ÷ DataLoader (batches/s) | ÷ baseline (batches/s) |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for cell in raw.cells:
        w, row = cell
        for arm in arms:
            if not raw.ok(cell, arm):
                err = "; ".join(sorted(set(raw.errors[cell][arm]))) or "no result"
                lines.append(f"| {w} | {row} | {ARM_LABEL[arm]} | FAILED: {err} | | | | |")
                continue
            vs_dl = ("1" if arm == "dl" else
                     common.ratio_text(raw, cell, arm, "dl", "batch_s") if "dl" in arms else "—")
            vs_base = ("—" if "base" not in arms or arm in ("dl", "base") else
                       common.ratio_text(raw, cell, arm, "base", "batch_s", spec=".3f"))
            lines.append(f"| {w} | {row} | {ARM_LABEL[arm]} | "
                         f"{common.cell_text(raw, cell, arm, 'batch_s')} | "
                         f"{common.cell_text(raw, cell, arm, 'worker_cpu_ms', '.2f')} | "
                         f"{common.cell_text(raw, cell, arm, 'main_cpu_ms', '.3f')} | {vs_dl} | {vs_base} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:  # before common.py touches sys.path
        child(json.loads(sys.argv[2]))
        return 0
    sys.path.insert(0, os.path.dirname(HERE))
    import common
    import procs
    import revisions
    import workload
    import writers

    p = common.parser(NAME, __doc__, reps=(3, 2), warmup_reps=(0, 0))
    p.add_argument("--workers", default=None, help='comma-separated (default "2,4"; quick "2")')
    p.add_argument("--rows", default="packed,per_sample", help="rows of bench/handoff.py")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per arm (4; quick 1.5)")
    p.add_argument("--resolution", type=int, default=workload.RESOLUTION,
                   help=f"image side (default {workload.RESOLUTION}); a small one (32) leaves the "
                        "workers' per-batch Python work, not the stack, in the CPU columns")
    p.add_argument("--min-batches", type=int, default=20, help="timed batches per arm at least")
    p.add_argument("--baseline", default=DEFAULT_BASELINE,
                   help=f"git revision for the 'base' arm (default {DEFAULT_BASELINE}; '' to leave it out)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per arm before it counts as failed")
    cfg = common.parse(p, argv)
    cfg.workers_list = [int(x) for x in (cfg.workers or ("2" if cfg.quick else "2,4")).split(",")]
    cfg.rows_list = [r.strip() for r in cfg.rows.split(",") if r.strip()]
    for r in cfg.rows_list:
        if r not in workload.ROW_LABEL or r == "count":
            rows = ", ".join(x for x in workload.ROW_LABEL if x != "count")
            p.error(f"unknown row {r!r}; choose from {rows}")
    cfg.seconds = cfg.seconds or (1.5 if cfg.quick else 4.0)
    cfg.arms = [a for a in ARMS if a != "base" or cfg.baseline]
    tmp = tempfile.mkdtemp(prefix="plthroughput-")
    try:
        trees = {"dl": ROOT, "pool": ROOT, "nostate": ROOT}
        rev = ""
        if cfg.baseline:
            found = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "--verify", "-q",
                                    cfg.baseline + "^{commit}"], capture_output=True, text=True)
            if found.returncode:
                p.error(f"--baseline {cfg.baseline!r} is not a commit of {ROOT} (a shallow clone "
                        "lacks old ones): give another revision, or --baseline '' to leave the arm out")
            rev = found.stdout.strip()
            trees["base"] = revisions.baseline_tree(cfg.baseline, tmp)
        here = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        cells = [(w, row) for w in cfg.workers_list for row in cfg.rows_list]
        load0, t0 = os.getloadavg()[0], time.perf_counter()

        def measure(cell, arm, rep):
            spec = {"arm": arm, "workers": cell[0], "row": cell[1], "tree": trees[arm],
                    "seconds": cfg.seconds, "min_batches": cfg.min_batches,
                    "resolution": cfg.resolution}
            return revisions.run_arm(HERE, spec, cfg.timeout)

        raw = common.interleave(cells, cfg.arms, measure, reps=cfg.reps, warmup_reps=cfg.warmup_reps,
                                label=NAME, stagger=True, show=lambda m: f"{m['batch_s']:.1f} batches/s")
    finally:
        revisions.remove_baseline_tree(tmp)
    head = (f"## batches/s with cached samples (bench/throughput.py{' --quick' if cfg.quick else ''})\n\n"
            f"batch {workload.BATCH}, {cfg.resolution}×{cfg.resolution}, RF-DETR shape, "
            f"next()+del only; {cfg.reps} reps × ≥{cfg.seconds:g} s per arm, each arm a fresh "
            f"process; this tree {here or '?'}"
            + (f", baseline {cfg.baseline} ({rev})" if cfg.baseline else "")
            + f"; {writers.env_line()}; 1-min load average {load0:.2f} at the start, "
            f"{os.getloadavg()[0]:.2f} at the end; run took {time.perf_counter() - t0:.0f} s.\n\n"
            "÷ columns: per-repetition ratios of batches/s between arms run side by side.\n\n")
    writers.write_outputs(cfg, head + table(raw, cfg), {"raw": raw.as_json(), "baseline": cfg.baseline,
                                                        "baseline_rev": rev, "tree_rev": here})
    return 0 if not procs.wait_no_children() else 1


if __name__ == "__main__":
    sys.exit(main())
