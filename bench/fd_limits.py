"""Descriptor limits: which loader survives which `ulimit -n`, by worker count.

Method. Every cell (loader x workers x RLIMIT_NOFILE) runs in a fresh child Python
that sets the limit (soft and hard) before it imports torch or poolloader, builds
the loader over bench/workload.py's RF-DETR shaped dataset (`RFDETRShaped`, batch 16;
per sample an image f32 [3,hw,hw], a bool mask [hw,hw] and a target dict of 7
tensors, n = 0..14 boxes) collated with `RFDETRCollate("per_sample")`: 114 tensors
per batch, row (d) of bench/handoff.py) and pulls `--batches`
batches, checking each has 114 tensors. A cell passes when every batch arrived;
otherwise it reports FAIL, the first line of the error and the function that
raised it (a child that runs past `--timeout` is killed and reported as a
timeout; a DataLoader timeout also shows the first error a worker printed). A
passing cell also shows main's open descriptors after the loader started / after
the last batch. With `--reps N` every cell runs N times (a fresh child each) and
shows "pass" only if all passed, else its first failure and how many passed.

Both loaders use their defaults: DataLoader with torch's default sharing strategy
(file_descriptor on Linux), pin_memory=False, prefetch_factor 2; PoolLoader with
1 MiB slots that grow on the first batch. Start method: the platform default (fork
on Linux), or `--context`. Nothing here is timed: the figures are pass/fail.

    python bench/fd_limits.py            # limits 64 256 1024 x workers 2 8 16 32
    python bench/fd_limits.py --quick    # limits 64 1024 x workers 2 32, 20 batches
    python bench/fd_limits.py --out results/
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (imports neither torch nor poolloader)
import procs  # noqa: E402  (imports neither torch nor poolloader)
import workload  # noqa: E402  (imports neither torch nor poolloader)
import writers  # noqa: E402  (imports neither torch nor poolloader)

NAME = "fd_limits"
TENSORS_PER_BATCH = 2 + workload.BATCH * 7


def _cell(limit: int, workers: int, loader: str, batches: int, hw: int, context: str) -> int:
    """Child body: the limit first, then the imports, then the loader."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    import warnings

    warnings.simplefilter("ignore")  # "N workers on 2 CPUs" is expected here
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from poolloader import PoolLoader

    data = workload.RFDETRShaped(64, resolution=hw)
    sampler = RandomSampler(data, replacement=True, num_samples=16 * batches,
                            generator=torch.Generator().manual_seed(0))
    pool = loader == "PoolLoader"
    cls = PoolLoader if pool else DataLoader
    kw = {"multiprocessing_context": context} if context != "default" else {}
    got, start_fds = 0, None
    try:
        it = iter(cls(data, batch_size=16, sampler=sampler,
                      collate_fn=workload.RFDETRCollate("per_sample", pool),
                      num_workers=workers, timeout=30, **kw))
        start_fds = procs.fd_count()
        for batch in it:
            count = 2 + sum(len(t) for t in batch[2])
            if count != TENSORS_PER_BATCH:
                raise AssertionError(f"batch {got} has {count} tensors")
            got += 1
            del batch
        end_fds = procs.fd_count()
        del it
    except BaseException as e:  # noqa: BLE001 - the cell's result is the error
        import traceback

        first = (str(e).strip().splitlines() or [""])[0][:120]
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
        print(f"RESULT FAIL after {got} batches: {type(e).__name__}"
              f"{': ' + first if first else ''} (in {where})", flush=True)
        traceback.print_exc()
        return 1
    if got != batches:
        print(f"RESULT FAIL: {got} of {batches} batches", flush=True)
        return 1
    print(f"RESULT pass ({start_fds}/{end_fds} fds)", flush=True)
    return 0


def run_cell(limit, workers, loader, batches, hw, context, timeout) -> tuple[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", str(limit), str(workers), loader,
           str(batches), str(hw), context]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"FAIL: timed out after {timeout:.0f} s", time.monotonic() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        result = lines[-1][len("RESULT "):]
        if "timed out" in result:  # say why: the first error a worker printed
            errors = [line for line in proc.stderr.splitlines()
                      if re.match(r"^[A-Za-z_.]+(Error|Exception): ", line)]
            if errors:
                result += f"; a worker: {errors[0][:120]}"
    else:  # died before it could report (a signal, an import error)
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:120]
        result = f"FAIL: exit {proc.returncode}: {tail}"
    return result, time.monotonic() - t0


def combined(results: list[str]) -> str:
    """One cell's text over its repetitions: the last pass, or the first failure and the count."""
    passed = [r for r in results if r.startswith("pass")]
    if len(passed) == len(results):
        return passed[-1]
    first = next(r for r in results if not r.startswith("pass"))
    return first if len(results) == 1 else f"{first} ({len(passed)}/{len(results)} passed)"


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__, reps=(1, 1), warmup_reps=(0, 0))
    ap.add_argument("--limits", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8, 16, 32])
    ap.add_argument("--loaders", nargs="+", default=["DataLoader", "PoolLoader"])
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--hw", type=int, default=96, help="image side (default 96; 576 is RF-DETR's)")
    ap.add_argument("--context", default="default", help="fork, spawn, forkserver or default")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per cell")
    ap.add_argument("--cell", nargs=6, help=argparse.SUPPRESS)
    args = common.parse(ap, argv)
    if args.cell:
        limit, workers, loader, batches, hw, context = args.cell
        return _cell(int(limit), int(workers), loader, int(batches), int(hw), context)
    if args.quick:
        args.limits, args.workers, args.batches = [64, 1024], [2, 32], 20

    import torch

    results = {}
    t0 = time.monotonic()
    for loader in args.loaders:
        for workers in args.workers:
            for limit in args.limits:
                runs = []
                for _ in range(args.reps):
                    result, took = run_cell(limit, workers, loader, args.batches, args.hw,
                                            args.context, args.timeout)
                    runs.append(result)
                    print(f"  {loader:10} workers={workers:<3} ulimit -n {limit:<5} {took:5.1f} s  "
                          f"{result}", file=sys.stderr, flush=True)
                results[loader, workers, limit] = combined(runs)
    head = (f"Descriptor limits: RF-DETR shaped batches (16 x [3,{args.hw},{args.hw}] + mask + 16 "
            f"target dicts = {TENSORS_PER_BATCH} tensors), {args.batches} batches per cell"
            f"{f', {args.reps} runs per cell' if args.reps > 1 else ''}, "
            f"start method {args.context}; torch {torch.__version__}, Python "
            f"{sys.version.split()[0]}, {os.cpu_count()} CPUs; {time.monotonic() - t0:.0f} s.\n"
            "Each cell: its own process with RLIMIT_NOFILE set before importing torch; "
            "pass (main's descriptors after start/at the end) or FAIL and the error's first line.")
    table = writers.markdown_table(
        ["loader", "workers"] + [f"ulimit -n {limit}" for limit in args.limits],
        [[loader, workers] + [results[loader, workers, limit].replace("|", "/")
                              for limit in args.limits]
         for loader in args.loaders for workers in args.workers],
        "lr" + "l" * len(args.limits))
    writers.write_outputs(args, f"### {NAME}\n\n{head}\n\n{table}\n",
                          {"results": {f"{l} {w} {n}": r for (l, w, n), r in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
