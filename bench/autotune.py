"""node_workers="auto" against fixed process counts: batches per second over a run of
epochs, and the count auto chose for each, in three loads, under fork and forkserver.

Every arm is PoolLoader(num_workers=4, batch_size=4, persistent_workers=False) over the
same data (`_autotune_data.Crunch`: a 256×256 matrix product `--rounds` times per
sample, CPU work in __getitem__), so every arm delivers the same batches (that is
tested: tests/test_autotune.py); only the number of processes hosting the 4 logical
workers differs. Arms: node_workers=1, 2, 4 and "auto" (which chooses again before
each epoch: poolloader.main.autotune; its CPU budget is this machine's, 2 cores here).

Scenarios (cells, with the start method):
  worker   the workers are the bottleneck: CPU-heavy samples, the consumer does nothing;
  main     the consumer is: a 40 ms "training step" (sleep) per batch, samples instant
           (rounds=0); the question is how few processes suffice;
  change   as "worker", and from the third of the epochs to the second third another
           process (a Python busy loop this bench starts and ends, by pid) takes a core;
  shift    one epoch of persistent workers whose load changes inside it, twice: its
           `--shift-batches` batches as "main", then "worker", then "main" again (the
           samples read their rounds from a file this bench rewrites at each switch).
           auto follows it only by moving within the epoch (every autotune.WINDOW_S
           of steady time).
Metrics per measurement: batches/s over the whole run (every epoch's start-up
included: non-persistent workers start each epoch); batches/s over the last half of the
epochs ("settled"; shift: the worker-bound part); auto's count per epoch (shift: its
counts in order, `/` at each switch, and the seconds from each switch to its first
move). Ratios: auto / the best fixed arm of the same repetition (paired), median
[min–max] over repetitions.

Usage:
  python bench/autotune.py [--quick] [--epochs 9] [--batches 24] [--rounds 8]
                           [--scenarios worker,main,change,shift] [--methods fork,forkserver]
                           [--shift-batches 150,450,150] [--out DIR] [--reps N]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import procs  # noqa: E402
import writers  # noqa: E402
from _autotune_data import Crunch  # noqa: E402

from poolloader import PoolLoader  # noqa: E402

NAME = "autotune"
WORKERS, BATCH = 4, 4
STEP_S = 0.04  # the "main" scenario's training step per batch
ARMS = ("1", "2", "4", "auto")
FIXED = ("1", "2", "4")
SCENARIOS = ("worker", "main", "change", "shift")


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure(cell, arm: str, args) -> dict:
    scenario, method = cell
    if scenario == "shift":
        return measure_shift(method, arm, args)
    rounds = 0 if scenario == "main" else args.rounds
    loader = PoolLoader(Crunch(args.batches * BATCH, rounds), batch_size=BATCH,
                        num_workers=WORKERS, multiprocessing_context=method,
                        node_workers="auto" if arm == "auto" else int(arm))
    epoch_s, counts, hog = [], [], None
    try:
        for epoch in range(args.epochs):
            if scenario == "change" and epoch == args.epochs // 3:
                hog = _hog()
            if scenario == "change" and epoch == 2 * args.epochs // 3 and hog is not None:
                hog.kill()
                hog.wait(10)
                hog = None
            t0, n = time.perf_counter(), 0
            for _batch in loader:
                n += 1
                if scenario == "main":
                    time.sleep(STEP_S)
            epoch_s.append(time.perf_counter() - t0)
            counts.append(loader.stats.processes)
            if n != args.batches:
                raise common.BenchError(f"epoch {epoch}: {n} batches, expected {args.batches}")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait(10)
        del loader
        left = procs.wait_clean()
    if left:
        raise common.BenchError(f"left behind after the measurement: {left}")
    half = epoch_s[len(epoch_s) // 2:]
    return {"batch_s": args.batches * len(epoch_s) / sum(epoch_s),
            "settled_batch_s": args.batches * len(half) / sum(half),
            "counts": "".join(str(c) for c in counts)}


def _set_rounds(path: str, rounds: int) -> None:
    """Replaced whole (a rename), so that no worker reads it half-written."""
    with open(path + ".new", "w") as f:
        f.write(str(rounds))
    os.replace(path + ".new", path)


def measure_shift(method: str, arm: str, args) -> dict:
    """One epoch of persistent workers: main-bound, worker-bound, main-bound again, for
    the `--shift-batches` counts (see the module docstring)."""
    phases = list(zip(("main", "worker", "main"), args.shift_batches))
    total = sum(args.shift_batches)
    ends = [sum(args.shift_batches[:i + 1]) for i in range(len(phases))]
    with tempfile.TemporaryDirectory(prefix="poolloader-autotune-") as tmp:
        rounds_file = os.path.join(tmp, "rounds")
        _set_rounds(rounds_file, 0)
        loader = PoolLoader(Crunch(total * BATCH, 0, rounds_file), batch_size=BATCH,
                            num_workers=WORKERS, multiprocessing_context=method,
                            persistent_workers=True,
                            node_workers="auto" if arm == "auto" else int(arm))
        counts: list[list[int]] = [[] for _ in phases]  # auto's counts in each phase
        follow: list[float | None] = [None] * len(phases)  # seconds to its first move
        switched = [0.0] * len(phases)  # when each phase began
        n, phase = 0, 0
        try:
            switched[0] = time.perf_counter()
            for _batch in loader:
                n += 1
                if phases[phase][0] == "main":
                    time.sleep(STEP_S)
                count = loader.stats.processes
                seen = counts[phase]
                if phase and not seen:
                    seen.append(counts[phase - 1][-1])
                if not seen or seen[-1] != count:
                    if phase and follow[phase] is None:
                        follow[phase] = time.perf_counter() - switched[phase]
                    seen.append(count)
                if n == ends[phase] and phase + 1 < len(phases):
                    phase += 1
                    _set_rounds(rounds_file, args.rounds if phases[phase][0] == "worker" else 0)
                    switched[phase] = time.perf_counter()
            end = time.perf_counter()
        finally:
            it = loader._iterator
            if it is not None:
                it._shutdown_workers()
            del loader, it
            left = procs.wait_clean()
    if left:
        raise common.BenchError(f"left behind after the measurement: {left}")
    if n != total:
        raise common.BenchError(f"{n} batches, expected {total}")
    return {"batch_s": n / (end - switched[0]),
            "settled_batch_s": args.shift_batches[1] / (switched[2] - switched[1]),
            "counts": "/".join("".join(map(str, c)) for c in counts),
            **{f"follow_{i}_s": s for i, s in enumerate(follow) if s is not None}}


def paired_best(raw, cell, metric: str):
    """auto / the best fixed arm of the same repetition, summarised over repetitions."""
    per_rep: dict[int, dict[str, float]] = {}
    for arm in ARMS:
        for rep, value in raw.values[cell][arm].get(metric, []):
            per_rep.setdefault(rep, {})[arm] = value
    return common.summarize(row["auto"] / max(row[a] for a in FIXED)
                            for row in per_rep.values() if len(row) == len(ARMS))


def render(raw, args) -> str:
    rows = []
    for cell in raw.cells:
        counts = [c for c in raw.series(cell, "auto", "counts") if c]
        for i, way in ((1, "to worker-bound"), (2, "back to main-bound")):
            follow = raw.series(cell, "auto", f"follow_{i}_s")
            if follow:
                counts.append(f"(moved {', '.join(f'{s:.1f}' for s in follow)} s after "
                              f"the switch {way})")
        rows.append([
            f"{cell[0]}, {cell[1]}",
            *(common.cell_text(raw, cell, arm, "batch_s", ".1f") for arm in ARMS),
            paired_best(raw, cell, "batch_s").fmt(".2f", "×"),
            *(common.cell_text(raw, cell, arm, "settled_batch_s", ".1f") for arm in ("4", "auto")),
            paired_best(raw, cell, "settled_batch_s").fmt(".2f", "×"),
            " ".join(counts) or "–",
        ])
    head = (f"node_workers=\"auto\" against fixed counts: PoolLoader(num_workers={WORKERS}, "
            f"batch_size={BATCH}), {args.epochs} epochs of {args.batches} batches, "
            f"non-persistent workers; samples of {args.rounds} rounds of a 256×256 product "
            f"(main: none, and a {STEP_S * 1e3:.0f} ms step per batch); change: a busy loop "
            f"takes a core from epoch {args.epochs // 3 + 1} to {2 * args.epochs // 3}; "
            f"shift: one epoch of persistent workers, {args.shift_batches[0]} batches as "
            f"main, {args.shift_batches[1]} as worker, {args.shift_batches[2]} as main "
            f"(settled: the worker part). "
            f"{args.reps} repetitions (+{args.warmup_reps} warm-up), median [min–max]; "
            f"auto / best fixed paired per repetition. {writers.env_line()}.")
    table = writers.markdown_table(
        ["scenario, start", "P=1 b/s", "P=2 b/s", "P=4 b/s", "auto b/s", "auto / best",
         "P=4 settled b/s", "auto settled b/s", "settled auto / best",
         "auto's count per epoch (each rep)"], rows, "lrrrrrrrrl")
    return f"### {NAME}\n\n{head}\n\n{table}\n"


def main(argv=None) -> None:
    p = common.parser(NAME, __doc__, reps=(3, 1), warmup_reps=(0, 0))
    p.add_argument("--epochs", type=int, default=None, help="epochs per run (9; quick 6)")
    p.add_argument("--batches", type=int, default=24, help="batches per epoch")
    p.add_argument("--rounds", type=int, default=8, help="matrix products per sample")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--methods", default="fork,forkserver")
    p.add_argument("--shift-batches", default="150,450,150",
                   help="shift: batches main-bound, worker-bound, main-bound")
    args = common.parse(p, argv)
    args.shift_batches = tuple(int(x) for x in args.shift_batches.split(","))
    if len(args.shift_batches) != 3 or min(args.shift_batches) < 1:
        p.error(f"--shift-batches: three positive counts, got {args.shift_batches}")
    args.epochs = args.epochs or (6 if args.quick else 9)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        p.error(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    cells = [(s, m) for s in scenarios for m in args.methods.split(",") if m]
    raw = common.interleave(cells, ARMS, lambda cell, arm, rep: measure(cell, arm, args),
                            args.reps, args.warmup_reps, label=NAME)
    text = render(raw, args)
    writers.write_outputs(args, text, {"summaries": common.summaries(
        raw, ["batch_s", "settled_batch_s"]), "env": writers.environment(),
        "counts": {str(c): raw.series(c, "auto", "counts") for c in cells}})


if __name__ == "__main__":
    main()
