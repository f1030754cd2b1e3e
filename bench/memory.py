"""Memory per worker: DataLoader and PoolLoader side by side (and PoolLoader at an
earlier revision), 4 workers, three datasets that make memory multiply with workers.

Parts (each a cell; every arm of a cell runs in its own fresh interpreter, one after
the other, the order rotated per repetition, as bench/throughput.py does):

  (a) arrays, under forkserver and spawn: a dataset holding a `--array-mib` MiB numpy
      array and a `--tensor-mib` MiB tensor, each item a row of both at a random
      place. DataLoader pickles the dataset into every worker: each unpickles its own
      copy of the numpy array, while torch's ForkingPickler moves the tensor into shared
      memory once (so DataLoader's workers already share the tensor). Measured:
      `pss_mib`, the sum of the workers' PSS (/proc/<pid>/smaps_rollup) after one epoch
      (persistent workers, read while they wait for the next one), and
      `first_s`, seconds from iter() to the first batch. Arms: DataLoader, PoolLoader
      (this tree), PoolLoader at `--baseline` (default bea7503; built with
      `revisions.baseline_tree`; `--baseline ''` leaves it out).
      Targets: PoolLoader's PSS sum ≤ 0.35 × DataLoader's; its first batch ≤ 0.5 × the
      baseline PoolLoader's.
  (b) Python objects under fork: a list of `--dicts` dicts, `--cow-items` items read at
      random. Each read of a dict writes its reference count, so fork's copy-on-write
      copies the page into the worker: its USS grows. Measured: `uss_growth_mib`, the
      median over workers of USS after the epoch minus USS after the first batch.
      Arms: DataLoader, PoolLoader, PoolLoader with the remedy `poolloader.frozen(list)`
      (skipped, with a message, where this tree has no `poolloader.frozen`).
      Target: with the remedy, ≤ 0.2 × DataLoader's growth.
  (c) a dataset that is an `nn.Module` with a `--buffer-mib` MiB buffer (fork): batches/s
      over `--seconds` of next()+del after a warm-up, DataLoader vs PoolLoader
      stateful=True (the default), and stateful=False beside them (what resume capture
      costs for a module-shaped dataset).
      Target: PoolLoader ≥ 0.9 × DataLoader's batches/s.
  (d) RF-DETR's batch (`workload.RFDETRShaped`, 16 × 576², per-sample targets) in one
      process with `--d-workers` (8) fork workers: an epoch of `--d-batches` batches of
      next()+del, with a pause of `--d-pause` seconds (0) at the middle batch. Measured:
      `pss_mib`, main's and the workers' PSS summed halfway through the epoch (read in
      a thread, so the loop does not stop for it), and the cgroup peak charge.
      Target: PoolLoader's cgroup peak ≤ 1.0 × DataLoader's (issue 45).

Every arm runs in a memory cgroup of its own (bench/cgroups.py; v1 or v2, skipped with
the reason where one cannot be made), and every part reports its peak charge
(`cgroup_peak_mib`): what a container's memory limit counts (anonymous memory, shmem
and memfd, the page cache the arm caused), which a PSS sum misses (batches queued
unmapped, pages reserved but not mapped).

Memory figures hardly depend on the machine's load; times do (a loaded 2-core machine
moves them by tens of percent): compare the ratios inside one run. The table gives
median [min–max] over repetitions, the paired per-repetition ratio, and each target
with "met" or "missed by" the factor between the measured ratio and the target; the
plot (--out / --plot) shows (a)'s PSS sums.

Usage:
    python bench/memory.py [--quick] [--parts a,b,c] [--workers 4] [--array-mib 512]
                           [--tensor-mib 256] [--dicts 500000] [--cow-items 200000]
                           [--buffer-mib 4] [--seconds 4] [--baseline REV] [--out DIR]
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

NAME = "memory"
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_BASELINE = "bea7503"
MIB = 1 << 20
BATCH = 8
ARM_LABEL = {"dl": "DataLoader", "pool": "PoolLoader", "base": "PoolLoader at baseline",
             "frozen": "PoolLoader + poolloader.frozen(list)",
             "stateful": "PoolLoader stateful=True", "nostate": "PoolLoader stateful=False"}
# (part, measured metric, arm, the arm it is compared to, bound, "le"/"ge", what it says)
TARGETS = [
    ("a", "pss_mib", "pool", "dl", 0.35, "le", "workers' PSS sum ≤ 0.35 × DataLoader's"),
    ("a", "first_s", "pool", "base", 0.5, "le", "first batch ≤ 0.5 × baseline PoolLoader's"),
    ("b", "uss_growth_mib", "frozen", "dl", 0.2, "le", "USS growth ≤ 0.2 × DataLoader's"),
    ("c", "batch_s", "stateful", "dl", 0.9, "ge", "batches/s ≥ 0.9 × DataLoader's"),
    ("d", "cgroup_peak_mib", "pool", "dl", 1.0, "le", "cgroup peak ≤ 1.0 × DataLoader's"),
]
CGROUP_ROW = ("cgroup_peak_mib", "cgroup peak MiB", ".0f")


# ---------------------------------------------------------------------------
# what each arm runs, in its own interpreter

def _smaps_reader():
    """This tree's /proc reader (poolloader/main/memory.py imports nothing of poolloader),
    loaded by path so that the baseline arm reads memory the same way."""
    spec = importlib.util.spec_from_file_location(
        "_bench_memory_reader", os.path.join(ROOT, "poolloader", "main", "memory.py"))
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _records(n: int) -> list:
    return [{"id": i, "file_name": f"train2017/{i:012d}.jpg", "category_id": 1 + i % 80,
             "area": float(i % 4096), "bbox": [float(i % 640), 0.0, 32.0, 24.0], "iscrowd": 0}
            for i in range(n)]


def child(spec: dict) -> None:
    """One arm in this fresh interpreter: prints one JSON line (figures, or `skipped`)."""
    sys.path.insert(0, os.path.dirname(HERE))
    import procs
    import revisions  # (through common) puts ROOT first on sys.path: the tree goes in front of it
    import workload
    revisions.use_tree(spec["tree"])
    import multiprocessing

    import torch
    from torch.utils.data import DataLoader

    import poolloader

    revisions.check_tree(poolloader, spec["tree"])
    reader = _smaps_reader()
    from _memory_data import Arrays, ModuleDataset, Records  # bench/: on sys.path here
    part, arm, workers = spec["part"], spec["arm"], spec["workers"]
    cls = DataLoader if arm == "dl" else poolloader.PoolLoader
    kwargs: dict = dict(batch_size=BATCH, num_workers=workers, persistent_workers=True,
                        timeout=spec["timeout"])
    if part == "a":
        data = Arrays(spec["array_mib"], spec["tensor_mib"], spec["batches"] * BATCH)
        kwargs["multiprocessing_context"] = multiprocessing.get_context(spec["method"])
    elif part == "b":
        items = _records(spec["dicts"])
        if arm == "frozen":
            frozen = getattr(poolloader, "frozen", None)
            if frozen is None:
                print(json.dumps({revisions.SKIPPED: "no poolloader.frozen in this tree"}))
                return
            items = frozen(items)
        data = Records(items)
        generator = torch.Generator().manual_seed(0)
        kwargs.update(sampler=torch.randint(0, spec["dicts"], (spec["cow_items"],),
                                            generator=generator).tolist(),
                      multiprocessing_context=multiprocessing.get_context("fork"))
        kwargs["batch_size"] = 256
    elif part == "d":
        data = workload.RFDETRShaped(spec["d_batches"] * workload.BATCH)
        kwargs = dict(batch_size=workload.BATCH, num_workers=spec["d_workers"],
                      collate_fn=workload.RFDETRCollate("per_sample", pool=arm != "dl"),
                      timeout=spec["timeout"],
                      multiprocessing_context=multiprocessing.get_context("fork"))
    else:
        data = ModuleDataset(spec["buffer_mib"], 10**9)
        kwargs["multiprocessing_context"] = multiprocessing.get_context("fork")
        if arm != "dl":  # stateful=True is the default; stateful=False shows what it costs
            kwargs["stateful"] = arm == "stateful"
    names0 = procs.shm_names()
    loader = cls(data, **kwargs)
    result: dict = {}
    pids: list[int] = []
    t0 = time.perf_counter()
    it = iter(loader)
    try:
        batch = next(it)
        result["first_s"] = time.perf_counter() - t0
        del batch
        pids = procs.note_workers(it)
        if part == "c":
            for _ in range(workers * 2 + 4):
                batch = next(it)
                del batch
            start, n = time.perf_counter(), 0
            while n < spec["min_batches"] or time.perf_counter() - start < spec["seconds"]:
                batch = next(it)
                del batch
                n += 1
            result["batch_s"] = n / (time.perf_counter() - start)
        elif part == "d":
            def read_pss() -> None:
                found = [reader.read_process(p) for p in [*pids, os.getpid()]]
                result["pss_mib"] = sum(m["pss"] for m in found if m) / MIB

            # PSS is read mid-run in a thread: its smaps_rollup reads take ~150 ms here
            # (kernel time, the GIL released), a pause that would let every worker
            # finish and so change the peak this part measures
            reading = threading.Thread(target=read_pss)
            for k, batch in enumerate(it):
                del batch
                if k == spec["d_batches"] // 2:
                    reading.start()
                    time.sleep(spec["d_pause"])
            reading.join(60)
        else:
            before = {p: reader.read_process(p) for p in pids}
            for batch in it:
                del batch
            # the epoch is over; persistent workers wait for the next one: read them now
            after = {p: reader.read_process(p) for p in pids}
            gone = [p for p in pids if before[p] is None or after[p] is None]
            if gone:
                raise SystemExit(f"workers {gone} exited before their memory was read")
            result["pss_mib"] = sum(after[p]["pss"] for p in pids) / MIB
            result["uss_mib"] = sum(after[p]["uss"] for p in pids) / MIB
            growth = sorted((after[p]["uss"] - before[p]["uss"]) / MIB for p in pids)
            result["uss_growth_mib"] = growth[len(growth) // 2]
    finally:
        workload.shutdown_iterator(it)
        del it, loader
    # what this arm left (bounded wait), as bench/throughput.py checks it
    result["left"] = revisions.arm_leftovers(names0, pids)
    print(json.dumps(result))


# ---------------------------------------------------------------------------
# the table

PARTS = {  # part -> (cells, arms, metrics shown as (metric, heading, format))
    "a": (("forkserver", "spawn"), ("dl", "pool", "base"),
          (("pss_mib", "workers' PSS MiB", ".0f"), ("first_s", "first batch s", ".2f"))),
    "b": (("fork",), ("dl", "pool", "frozen"),
          (("uss_growth_mib", "USS growth MiB / worker", ".1f"), ("uss_mib", "workers' USS MiB", ".0f"))),
    "c": (("fork",), ("dl", "stateful", "nostate"), (("batch_s", "batches/s", ".1f"),)),
    "d": (("fork",), ("dl", "pool"), (("cgroup_peak_mib", "cgroup peak MiB", ".0f"),
                                      ("pss_mib", "main's + workers' PSS MiB", ".0f"))),
}
PART_TITLE = {"a": "(a) a numpy array and a tensor, read at random",
              "b": "(b) a list of dicts under fork",
              "c": "(c) an nn.Module dataset with a buffer",
              "d": "(d) RF-DETR's batch, one process, fork workers"}


def _verdict(raw, cell, metric, arm, base, bound, sense) -> str:
    import common
    r = common.ratio(raw, cell, arm, base, metric)
    if not r.n:
        why = sorted(set(raw.errors[cell][arm] + raw.errors[cell][base]))
        return "not measured" + (f" ({'; '.join(why)})" if why else "")
    met = r.median <= bound if sense == "le" else r.median >= bound
    if met:
        return f"{r.median:.2f}× — met"
    return f"{r.median:.2f}× — missed by {r.median / bound if sense == 'le' else bound / r.median:.2f}×"


def table(raw, cfg) -> str:
    import common
    import revisions
    import writers
    out = []
    for part in cfg.parts_list:
        _cells, arms, metrics = PARTS[part]
        if CGROUP_ROW not in metrics:
            metrics = (*metrics, CGROUP_ROW)
        arms = [a for a in arms if a in cfg.arms]
        rows = []
        for cell in [c for c in raw.cells if c[0] == part]:
            for arm in arms:
                row = [cell[1], ARM_LABEL[arm]]
                skipped = [e for e in raw.errors[cell][arm] if e.startswith(revisions.SKIPPED)]
                for metric, _head, spec in metrics:
                    if skipped and not raw.ok(cell, arm):
                        row += [skipped[0], "–"]
                        continue
                    row.append(common.cell_text(raw, cell, arm, metric, spec))
                    row.append("1" if arm == "dl" else common.ratio_text(raw, cell, arm, "dl", metric))
                rows.append(row)
        heads = ["start method", "loader"]
        for _metric, head, _spec in metrics:
            heads += [head, "÷ DataLoader"]
        out.append(f"### {PART_TITLE[part]}\n\n"
                   + writers.markdown_table(heads, rows, "ll" + "r" * (len(heads) - 2)))
    targets = []
    for part, metric, arm, base, bound, sense, text in TARGETS:
        if part not in cfg.parts_list or arm not in cfg.arms or base not in cfg.arms:
            continue
        for cell in [c for c in raw.cells if c[0] == part]:
            targets.append([f"({part}) {cell[1]}", text,
                            _verdict(raw, cell, metric, arm, base, bound, sense)])
    out.append("### Targets\n\n" + writers.markdown_table(
        ["part", "target", "measured ratio (median of the paired repetitions)"],
        targets, "lll"))
    return "\n\n".join(out)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:  # before common.py touches sys.path
        child(json.loads(sys.argv[2]))
        return 0
    sys.path.insert(0, os.path.dirname(HERE))
    import common
    import procs
    import revisions
    import writers

    p = common.parser(NAME, __doc__, reps=(3, 1), warmup_reps=(0, 0))
    p.add_argument("--parts", default="a,b,c,d", help="which parts (a, b, c, d; comma-separated)")
    p.add_argument("--d-workers", type=int, default=8, help="(d) workers (default 8)")
    p.add_argument("--d-batches", type=int, default=None, help="(d) batches (40; quick 24)")
    p.add_argument("--d-pause", type=float, default=0.0,
                   help="(d) seconds the consumer pauses at the middle batch (0: none), as a "
                        "training loop does to log or evaluate")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--array-mib", type=int, default=None, help="(a) numpy array MiB (512; quick 128)")
    p.add_argument("--tensor-mib", type=int, default=None, help="(a) tensor MiB (256; quick 64)")
    p.add_argument("--batches", type=int, default=32, help=f"(a) batches of {BATCH} per epoch")
    p.add_argument("--dicts", type=int, default=None, help="(b) dicts in the list (500000; quick 100000)")
    p.add_argument("--cow-items", type=int, default=None,
                   help="(b) items read at random in the epoch (200000; quick 50000)")
    p.add_argument("--buffer-mib", type=int, default=4, help="(c) the module's buffer MiB")
    p.add_argument("--seconds", type=float, default=None, help="(c) timed seconds per arm (4; quick 1.5)")
    p.add_argument("--min-batches", type=int, default=20, help="(c) timed batches per arm at least")
    p.add_argument("--baseline", default=DEFAULT_BASELINE,
                   help=f"git revision for (a)'s baseline arm (default {DEFAULT_BASELINE}; "
                        "'' to leave it out)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per arm before it counts as failed")
    cfg = common.parse(p, argv)
    cfg.parts_list = [x.strip() for x in cfg.parts.split(",") if x.strip()]
    for part in cfg.parts_list:
        if part not in PARTS:
            p.error(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
    if cfg.workers < 1:
        p.error(f"--workers must be >= 1, got {cfg.workers}")
    cfg.array_mib = cfg.array_mib or (128 if cfg.quick else 512)
    cfg.tensor_mib = cfg.tensor_mib or (64 if cfg.quick else 256)
    cfg.dicts = cfg.dicts or (100_000 if cfg.quick else 500_000)
    cfg.cow_items = cfg.cow_items or (50_000 if cfg.quick else 200_000)
    cfg.seconds = cfg.seconds or (1.5 if cfg.quick else 4.0)
    cfg.d_batches = cfg.d_batches or (24 if cfg.quick else 40)
    cfg.arms = [a for a in ARM_LABEL if a != "base" or cfg.baseline]
    tmp = tempfile.mkdtemp(prefix="plmemory-")
    rev = ""
    try:
        trees = dict.fromkeys(ARM_LABEL, ROOT)
        if cfg.baseline and "a" in cfg.parts_list:
            found = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "--verify", "-q",
                                    cfg.baseline + "^{commit}"], capture_output=True, text=True)
            if found.returncode:
                p.error(f"--baseline {cfg.baseline!r} is not a commit of {ROOT} (a shallow clone "
                        "lacks old ones): give another revision, or --baseline '' to leave the arm out")
            rev = found.stdout.strip()
            trees["base"] = revisions.baseline_tree(cfg.baseline, tmp)
        here = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        cells = [(part, method) for part in cfg.parts_list for method in PARTS[part][0]]
        load0, t0 = os.getloadavg()[0], time.perf_counter()

        def measure(cell, arm, rep):
            spec = {"part": cell[0], "method": cell[1], "arm": arm, "tree": trees[arm],
                    "workers": cfg.workers, "timeout": cfg.timeout, "array_mib": cfg.array_mib,
                    "tensor_mib": cfg.tensor_mib, "batches": cfg.batches, "dicts": cfg.dicts,
                    "cow_items": cfg.cow_items, "buffer_mib": cfg.buffer_mib,
                    "seconds": cfg.seconds, "min_batches": cfg.min_batches,
                    "d_workers": cfg.d_workers, "d_batches": cfg.d_batches,
                    "d_pause": cfg.d_pause}
            return revisions.run_arm(HERE, spec, cfg.timeout, cgroup=True)

        raw = _interleave_parts(common, cells, cfg, measure)
    finally:
        revisions.remove_baseline_tree(tmp)
    head = (f"## Memory per worker (bench/memory.py{' --quick' if cfg.quick else ''})\n\n"
            f"{cfg.workers} workers, batch {BATCH} ((b): 256); (a) array {cfg.array_mib} MiB + "
            f"tensor {cfg.tensor_mib} MiB, {cfg.batches} batches; (b) {cfg.dicts} dicts, "
            f"{cfg.cow_items} random reads; (c) buffer {cfg.buffer_mib} MiB, ≥{cfg.seconds:g} s; "
            f"(d) {cfg.d_workers} workers, {cfg.d_batches} batches, pause {cfg.d_pause:g} s; "
            f"{cfg.reps} reps, each arm a fresh process; this tree {here or '?'}"
            + (f", baseline {cfg.baseline} ({rev})" if rev else "")
            + f"; {writers.env_line()}; 1-min load average {load0:.2f} at the start, "
            f"{os.getloadavg()[0]:.2f} at the end; run took {time.perf_counter() - t0:.0f} s.\n\n"
            "Cells: median [min–max]; ÷ columns: per-repetition ratios between arms run "
            "side by side. Memory figures hardly depend on load; times do.\n\n")
    writers.write_outputs(cfg, head + table(raw, cfg), {"raw": raw.as_json(), "baseline": cfg.baseline,
                                                        "baseline_rev": rev, "tree_rev": here})
    if cfg.plot and "a" in cfg.parts_list:
        methods = PARTS["a"][0]
        writers.plot_bars(cfg.plot, list(methods),
                          {ARM_LABEL[arm]: [common.summarize(raw.series(("a", m), arm, "pss_mib"))
                                            for m in methods]
                           for arm in PARTS["a"][1] if arm in cfg.arms},
                          ylabel="workers' PSS sum, MiB",
                          title=f"(a) {cfg.workers} workers, {cfg.array_mib} MiB array + "
                               f"{cfg.tensor_mib} MiB tensor")
    return 0 if not procs.wait_no_children() else 1


def _interleave_parts(common, cells, cfg, measure):
    """common.interleave over each part's own arms (parts have different arms), merged
    into one Raw over every cell and arm."""
    raw = common.Raw(cells, cfg.arms)
    for part in cfg.parts_list:
        part_cells = [c for c in cells if c[0] == part]
        arms = [a for a in PARTS[part][1] if a in cfg.arms]
        got = common.interleave(part_cells, arms, measure, reps=cfg.reps,
                                warmup_reps=cfg.warmup_reps, label=f"{NAME} ({part})",
                                show=lambda m: ", ".join(f"{k}={v:.3g}" for k, v in m.items()
                                                         if isinstance(v, (int, float))))
        for cell in part_cells:
            for arm in arms:
                raw.values[cell][arm] = got.values[cell][arm]
                raw.errors[cell][arm] = got.errors[cell][arm]
    return raw


if __name__ == "__main__":
    sys.exit(main())
