"""What mid-epoch resume costs: state_dict(), the main process's per-batch path, the worker.

Three measures, each side by side in one run:

1. ``state_dict()`` at 2 / 8 / 32 workers, PoolLoader next to torchdata's
   StatefulDataLoader (same dataset, batch size, shuffle, workers). Each loader is
   iterated until every worker has delivered a batch, then ``state_dict()`` is
   timed ``--calls`` times (perf_counter) while its workers keep prefetching;
   reported: µs per call, median [min–max], and the size of the state as
   ``torch.save`` writes it. StatefulDataLoader builds its snapshot on every step
   (snapshot_every_n_steps=1, its default) and returns it; PoolLoader keeps each
   worker's record bytes per batch and decodes them here: O(workers).

2. The main process's per-batch cost, before and after this change: the same
   benchmark loop run on ``--baseline`` (a git revision, default origin/main,
   checked out into a temporary worktree; its compiled extensions are copied from
   this tree when their sources are the same, else built) and on this tree, in
   child processes, alternating (the order rotated per round). The loop is
   DataLoader's hand-off at its cheapest: a one-tensor batch (so the fixed
   per-batch cost is what shows), 2 workers; before each ``next()`` the main
   thread sleeps ``--sleep-ms`` so the batch is waiting; timed: ``next()`` + ``del``
   of the batch. Reported: µs per batch, median over the batches of a round,
   then median [min–max] over ``--rounds`` rounds; the difference of medians is
   the change's cost (a few µs are within the noise of a shared machine: the
   spread is shown). Then the same loop in one process with the iterator's resume
   hooks on and swapped for the pre-change path (the main process's side alone,
   workers unchanged), and the operations the change adds per batch timed alone
   (copy of the worker's record out of a real slot, the tracker's hand-over, a
   sampler draw through the tracker).

3. The worker's side: what each worker adds per batch (capture of its RNG states,
   pickled with its dataset position), timed in this process with the code the
   worker runs; and the record's size.

Usage::

    python bench/state.py [--quick] [--reps N] [--out DIR] [--json PATH] [--baseline REV]

It runs on bench/common.py's parser (`--reps`: the rounds of part 2, and of the repeats
of parts 2 and 3) and summary ("median [min–max]"), bench/revisions.py's baseline tree and
bench/writers.py. They are imported only in the parent: common.py puts this tree first on
sys.path, and the per-batch child must import the tree it was started in.
"""
from __future__ import annotations

import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def med_range(values, scale=1.0, spec=".1f") -> str:
    import common  # see the module docstring: never in the per-batch child

    return common.summarize(x * scale for x in values).fmt(spec)


# ---------------------------------------------------------------------------
# 1. state_dict()

class Tiny:  # a map-style dataset with a random augmentation; module level for spawn
    def __len__(self):
        return 100000

    def __getitem__(self, i):
        import torch
        return torch.rand(4) + i


def _statefuldataloader():
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def measure_state_dict(loader_cls, workers: int, calls: int) -> dict:
    import torch
    loader = loader_cls(Tiny(), batch_size=8, shuffle=True, num_workers=workers)
    it = iter(loader)
    for _ in range(2 * workers + 1):  # every worker has delivered
        next(it)
    tracker = getattr(loader, "_resume_tracker", None)
    cold, warm = [], []
    state = None
    for _ in range(calls):
        if tracker is not None:  # forget the decoded records: every worker's is decoded again
            tracker._decoded.clear()
        t0 = time.perf_counter()
        state = loader.state_dict()
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loader.state_dict()
        warm.append(time.perf_counter() - t0)
    buf = io.BytesIO()
    torch.save(state, buf)
    del it, loader
    return {"us": [t * 1e6 for t in cold], "warm_us": [t * 1e6 for t in warm], "bytes": buf.tell()}


def measure_step(loader_cls, workers: int, batches: int, sleep_s: float, save: bool = False,
                 **kw) -> list:
    """µs of main thread per next()+del (+ state_dict() with `save`) with the batch
    waiting (one value per batch)."""
    loader = loader_cls(Tiny(), batch_size=8, shuffle=True, num_workers=workers, **kw)
    it = iter(loader)
    for _ in range(2 * workers + 1):
        next(it)
    times = []
    for _ in range(batches):
        time.sleep(sleep_s)
        t0 = time.perf_counter()
        batch = next(it)
        del batch
        if save:
            loader.state_dict()
        times.append(time.perf_counter() - t0)
    del it, loader
    return [t * 1e6 for t in times]


# ---------------------------------------------------------------------------
# 2. per-batch main-process cost, before/after (runs in a child per tree)

class One:
    def __init__(self, numel=16):
        self.numel = numel

    def __len__(self):
        return 10 ** 6

    def __getitem__(self, i):
        import torch
        return torch.full((self.numel,), i, dtype=torch.float32)


def timed_next(it, batches: int, sleep_s: float) -> tuple[float, float]:
    """After 20 warm-up batches: (median wall µs, mean main-thread CPU µs) of next()+del
    per batch, each after `sleep_s` so the batch is waiting."""
    for _ in range(20):
        next(it)
    wall, cpu = [], []
    for _ in range(batches):
        time.sleep(sleep_s)
        t0, c0 = time.perf_counter(), time.thread_time()
        batch = next(it)
        del batch
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall) * 1e6, sum(cpu) / len(cpu) * 1e6


def per_batch_child(batches: int, sleep_s: float) -> None:
    """Child: µs per batch for next()+del with the batch waiting; prints JSON."""
    from poolloader import PoolLoader
    loader = PoolLoader(One(), batch_size=None, num_workers=2)
    it = iter(loader)
    median_us, cpu_us = timed_next(it, batches, sleep_s)
    del it, loader
    print(json.dumps({"median_us": median_us, "cpu_us": cpu_us}))


def hooks_ab(rounds: int, batches: int, sleep_s: float) -> dict:
    """The same loop in this process, this tree, with the iterator's resume hooks on
    and swapped for the pre-change path (no record copied, no hand-over, DataLoader's
    own __next__ and _next_index); iterators alternate. Workers capture in both arms:
    this isolates the main process's side."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from poolloader import PoolLoader
    from poolloader.main.iterator import PoolLoaderIter
    from poolloader.resume import tracker as resume_state

    class Quiet(resume_state.ResumeTracker):
        def next_index(self, sampler_iter, seq):
            return next(sampler_iter)

        def received(self, *args):
            pass

        def commit(self):
            pass

    class Off(PoolLoaderIter):
        __next__ = _BaseDataLoaderIter.__next__

        def _reply_record(self, slot):
            return None

    def run(off: bool) -> tuple:
        loader = PoolLoader(One(), batch_size=None, num_workers=2)
        it = iter(loader)
        if off:
            it.__class__, it._resume.__class__ = Off, Quiet
        result = timed_next(it, batches, sleep_s)
        del it, loader
        return result

    out = {"on": {"wall": [], "cpu": []}, "off": {"wall": [], "cpu": []}}
    for r in range(2 * rounds):
        for arm in (("on", "off") if r % 2 == 0 else ("off", "on")):
            wall, cpu = run(arm == "off")
            out[arm]["wall"].append(wall)
            out[arm]["cpu"].append(cpu)
    return out


def run_per_batch(tree: str, batches: int, sleep_s: float) -> float:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--per-batch-child", str(batches), str(sleep_s)],
        cwd=tree, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True,
        timeout=600)
    if out.returncode:
        raise RuntimeError(f"per-batch child in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_added_ops(repeat: int) -> dict:
    """The calls this change adds to the per-batch path, timed alone on a real slot."""
    from poolloader import PoolLoader
    from poolloader.wire import slot_format as fmt
    loader = PoolLoader(One(1 << 15), batch_size=None, num_workers=2)  # 128 KiB: a view
    it = iter(loader)
    batch = next(it)  # its slot stays LEASED (and its record intact) while we hold it
    ledger = it._ledger
    slot = next(iter(ledger.leases.values()))
    mapping, header = ledger.mapping(slot), ledger.header(slot)
    record = fmt.reply_state(mapping, header)
    tracker = it._resume

    def copy():
        fmt.reply_state(mapping, header)

    def hand_over():
        tracker.received(0, 1, record, False)
        tracker.commit()

    indices = iter(range(10 ** 9))

    def next_index():  # the iterator's _next_index, as it now goes through the tracker
        tracker.next_index(indices, 0)

    out = {"record_bytes": len(record)}
    for name, fn in (("copy_record", copy), ("hand_over", hand_over), ("next_index", next_index)):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            times.append((time.perf_counter() - t0) / 100)
        out[name + "_us"] = [t * 1e6 for t in times]
    del batch, it, loader
    return out


# ---------------------------------------------------------------------------
# 3. the worker's side

def measure_capture(repeat: int) -> dict:
    import torch
    from torch.utils.data.dataloader import _DatasetKind

    from poolloader.resume.keys import WorkerProgress
    progress = WorkerProgress(None, One(), iterable=False)
    fetcher = progress.first_fetcher(lambda: _DatasetKind.create_fetcher(
        _DatasetKind.Map, One(), False, lambda x: x, False))
    torch.rand(1)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(50):
            blob = progress.capture(fetcher)
        times.append((time.perf_counter() - t0) / 50)
    return {"capture_us": [t * 1e6 for t in times], "record_bytes": len(blob)}


# ---------------------------------------------------------------------------

def main() -> None:
    if sys.argv[1:2] == ["--per-batch-child"]:  # before common.py touches sys.path
        per_batch_child(int(sys.argv[2]), float(sys.argv[3]))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    import revisions
    import writers

    parser = common.parser("state", __doc__, reps=(5, 3), warmup_reps=(0, 0))
    parser.add_argument("--workers", default="2,8,32")
    parser.add_argument("--calls", type=int, default=None, help="state_dict() calls (default 50; quick 20)")
    parser.add_argument("--baseline", default="origin/main",
                        help="git revision to compare the per-batch cost with ('' to skip)")
    parser.add_argument("--batches", type=int, default=None,
                        help="batches per round of part 2 (default 300; quick 150)")
    parser.add_argument("--sleep-ms", type=float, default=2.0)
    args = common.parse(parser)
    args.calls = args.calls or (20 if args.quick else 50)
    args.batches = args.batches or (150 if args.quick else 300)
    args.rounds = args.reps
    text: list[str] = []

    def say(line: str) -> None:  # printed now; the whole report also goes to --markdown
        print(line, flush=True)
        text.append(line)

    warnings.simplefilter("ignore")
    sys.path.insert(0, ROOT)
    from poolloader import PoolLoader

    raw: dict = {"load_average": os.getloadavg()}
    say(f"# bench/state.py  (Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f})\n")

    # 1
    stateful = _statefuldataloader()
    rows, raw["state_dict"] = [], {}
    for workers in [int(w) for w in args.workers.split(",")]:
        pool = measure_state_dict(PoolLoader, workers, args.calls)
        ref = measure_state_dict(stateful, workers, args.calls) if stateful else None
        raw["state_dict"][workers] = {"pool": pool, "stateful": ref}
        ratio = (f"{statistics.median(pool['us']) / statistics.median(ref['us']):.2f}×"
                 if ref else "–")
        rows.append(f"| {workers} | {med_range(pool['us'])} | {med_range(pool['warm_us'])} | "
                    f"{med_range(ref['us']) if ref else 'not installed'} | {ratio} | "
                    f"{pool['bytes']:,} / {ref['bytes'] if ref else 0:,} |")
    say("## state_dict(), µs per call, median [min–max]\n")
    say("PoolLoader decodes each worker's latest record (cold: all of them); a record once "
          "decoded is kept, so a repeated call decodes only the workers that delivered since "
          "(warm: none).\n")
    say("| workers | PoolLoader cold | PoolLoader warm | StatefulDataLoader | Pool cold / SDL | "
          "torch.save bytes Pool / SDL |")
    say("|---:|---:|---:|---:|---:|---:|")
    say("\n".join(rows) + "\n")
    if stateful:
        # StatefulDataLoader's state_dict() returns the snapshot it builds on every step:
        # its cost is in next(). Shown: its next() with and without per-step snapshots,
        # and both loaders' next()+state_dict() when saving at every step.
        steps = max(args.batches // 3, 40)
        sleep = args.sleep_ms / 1000
        rows, raw["per_step"] = [], {}
        for workers in [int(w) for w in args.workers.split(",")]:
            on = measure_step(stateful, workers, steps, sleep, snapshot_every_n_steps=1)
            off = measure_step(stateful, workers, steps, sleep, snapshot_every_n_steps=0)
            pool_save = measure_step(PoolLoader, workers, steps, sleep, save=True)
            sdl_save = measure_step(stateful, workers, steps, sleep, save=True)
            raw["per_step"][workers] = {"sdl_snapshots": on, "sdl_no_snapshots": off,
                                        "pool_save_every_step": pool_save,
                                        "sdl_save_every_step": sdl_save}
            rows.append(f"| {workers} | {med_range(on)} | {med_range(off)} | "
                        f"{statistics.median(on) - statistics.median(off):+.1f} | "
                        f"{med_range(pool_save)} | {med_range(sdl_save)} |")
        say(f"StatefulDataLoader builds its state at every step instead; main-thread µs per "
              f"step, median [min–max] over {steps} steps (batch waiting):\n")
        say("| workers | SDL next(), snapshots on | SDL next(), off | SDL per-step snapshot | "
              "Pool next()+state_dict() | SDL next()+state_dict() |")
        say("|---:|---:|---:|---:|---:|---:|")
        say("\n".join(rows) + "\n")

    # 2
    ops = measure_added_ops(args.rounds * 4)
    raw["added_ops"] = ops
    say("## main process, per batch\n")
    say(f"Added calls, alone: copy of the worker's record out of the slot ({ops['record_bytes']:,} "
          f"bytes) {med_range(ops['copy_record_us'], spec='.2f')} µs; tracker hand-over "
          f"{med_range(ops['hand_over_us'], spec='.2f')} µs; sampler draw through the tracker "
          f"{med_range(ops['next_index_us'], spec='.2f')} µs.\n")
    ab = hooks_ab(args.rounds, args.batches, args.sleep_ms / 1000)
    raw["hooks_ab_us"] = ab
    say(f"next()+del of a waiting one-tensor batch, 2 workers, in this process: the resume "
          f"hooks on, and swapped for the pre-change path; wall (median of {args.batches} "
          f"batches) and main-thread CPU (mean per batch), median [min–max] of {2 * args.rounds} "
          "rounds, alternating:\n")
    say("| main path | wall µs per batch | main-thread CPU µs per batch |\n|---|---:|---:|")
    for arm, label in (("off", "pre-change (hooks off)"), ("on", "with resume hooks")):
        say(f"| {label} | {med_range(ab[arm]['wall'])} | {med_range(ab[arm]['cpu'])} |")
    say(f"\nDifference of medians: wall "
          f"{statistics.median(ab['on']['wall']) - statistics.median(ab['off']['wall']):+.1f} µs, CPU "
          f"{statistics.median(ab['on']['cpu']) - statistics.median(ab['off']['cpu']):+.1f} µs per batch.\n")
    if args.baseline:
        tmp = tempfile.mkdtemp(prefix="plstate-")
        try:
            base = revisions.baseline_tree(args.baseline, tmp)
            trees = {"baseline": base, "this tree": ROOT}
            results = {name: {"wall": [], "cpu": []} for name in trees}
            for r in range(2 * args.rounds):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for name in order:
                    got = run_per_batch(trees[name], args.batches, args.sleep_ms / 1000)
                    results[name]["wall"].append(got["median_us"])
                    results[name]["cpu"].append(got["cpu_us"])
            raw["per_batch_us"] = results
            rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.baseline],
                                 capture_output=True, text=True).stdout.strip()
            say(f"next()+del of a waiting one-tensor batch, 2 workers, µs: wall (median of "
                  f"{args.batches} batches per round) and main-thread CPU (mean per batch); "
                  f"median [min–max] of {2 * args.rounds} rounds, trees alternating:\n")
            say("| tree | wall µs per batch | main-thread CPU µs per batch |\n|---|---:|---:|")
            say(f"| baseline {args.baseline} ({rev}) | {med_range(results['baseline']['wall'])} | "
                  f"{med_range(results['baseline']['cpu'])} |")
            say(f"| this tree | {med_range(results['this tree']['wall'])} | "
                  f"{med_range(results['this tree']['cpu'])} |")
            diff = {m: statistics.median(results["this tree"][m]) - statistics.median(results["baseline"][m])
                    for m in ("wall", "cpu")}
            say(f"\nDifference of medians: wall {diff['wall']:+.1f} µs, CPU {diff['cpu']:+.1f} µs "
                  "per batch.\n")
        finally:
            revisions.remove_baseline_tree(tmp)

    # 3
    cap = measure_capture(args.rounds * 4)
    raw["worker_capture"] = cap
    say("## worker, per batch\n")
    say(f"Record capture (random + numpy + torch RNG states, pickled): "
          f"{med_range(cap['capture_us'])} µs, {cap['record_bytes']:,} bytes.\n")

    if args.markdown:
        writers.write_text(args.markdown, "\n".join(text))
    if args.json:
        writers.write_json(args.json, {"bench": "state", "config": vars(args), **raw})


if __name__ == "__main__":
    main()
