"""The one benchmark runner: every bench/*.py parses, runs and summarises through it.

Parser (`parser` + `parse`): every benchmark takes `--quick`, `--reps` (alias
`--repeats`), `--warmup-reps`, `--out DIR` (writes `<name>.md`, `<name>.json`
and `<name>.png` there), `--json/--markdown/--plot PATH`; `runner_argv` is how
bench/run_all.py drives them all with the same flags.

Method (what `interleave` guarantees):
  * every cell (one point of a sweep: a worker count, a payload size, ...) runs
    every arm once per repetition, back to back, so arms compared with each
    other ran seconds apart on the same machine state;
  * the arm order is rotated from one repetition to the next (no arm always
    goes first, nor always follows the same neighbour); with `stagger` also
    from one cell to the next;
  * `warmup_reps` whole repetitions run first and are thrown away (imports,
    page cache, allocator and CPU-frequency warm-up); benches also exclude
    warm-up batches inside each measurement;
  * a measurement that raises is recorded as FAILED with its error, and the
    run goes on.
Summaries are median [min–max] over the kept repetitions (`Summary.fmt`, the
one formatter). Ratios to a baseline arm are computed per repetition between
the two arms measured side by side (paired), then summarised the same way. On
a shared 2-core machine absolute numbers are noise; ratios measured in one run
are the figures.

Beside it, one concern each: writers.py (tables, JSON, plots), procs.py (/proc
and hygiene), revisions.py (another git revision, one arm per fresh interpreter),
workload.py (the RF-DETR-shaped data and how a loader is measured on it).

Importing this module puts the repository on sys.path (fixtures/ is not
installed). Nothing here imports torch or poolloader at import time
(bench/fd_limits.py sets its descriptor limit before either is loaded).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the data generators in fixtures/ are not installed
    sys.path.insert(0, REPO)
DEFAULT_RESULTS = os.path.join(REPO, "results")


# ---------------------------------------------------------------------------
# the shared parser

def parser(name: str, doc: str, *, reps=(5, 3), warmup_reps=(1, 0)) -> argparse.ArgumentParser:
    """An ArgumentParser with every benchmark's common flags; finish with `parse`.

    `reps` and `warmup_reps`: (full, quick) defaults of this benchmark."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(bench=name, _defaults={"reps": reps, "warmup_reps": warmup_reps})
    p.add_argument("--quick", action="store_true", help="short run (what run_all --quick runs)")
    p.add_argument("--reps", "--repeats", dest="reps", type=int, default=None,
                   help=f"kept repetitions (default {reps[0]}, quick {reps[1]})")
    p.add_argument("--warmup-reps", type=int, default=None,
                   help=f"discarded repetitions first (default {warmup_reps[0]}, "
                        f"quick {warmup_reps[1]})")
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"write {name}.md, {name}.json and {name}.png into DIR")
    p.add_argument("--json", metavar="PATH", help="write raw numbers and summaries")
    p.add_argument("--markdown", metavar="PATH", help="write the table")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    return p


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse and fill the common defaults (quick or full; paths under --out)."""
    args = p.parse_args(argv)
    defaults = args._defaults
    del args._defaults
    pick = 1 if args.quick else 0
    if args.reps is None:
        args.reps = defaults["reps"][pick]
    if args.warmup_reps is None:
        args.warmup_reps = defaults["warmup_reps"][pick]
    if args.reps < 1 or args.warmup_reps < 0:
        p.error(f"--reps must be >= 1 and --warmup-reps >= 0, got {args.reps}, {args.warmup_reps}")
    if args.out:
        args.json = args.json or os.path.join(args.out, f"{args.bench}.json")
        args.markdown = args.markdown or os.path.join(args.out, f"{args.bench}.md")
        args.plot = args.plot or os.path.join(args.out, f"{args.bench}.png")
    return args


def runner_argv(out: str, quick: bool = False, reps: int | None = None) -> list[str]:
    """The flags bench/run_all.py gives every benchmark (all take them: see `parser`)."""
    argv = ["--out", out]
    if quick:
        argv.append("--quick")
    if reps is not None:
        argv += ["--reps", str(reps)]
    return argv


# ---------------------------------------------------------------------------
# the method: running arms

def rotated(arms: Sequence[str], k: int) -> list[str]:
    """`arms` rotated left by `k` (k = repetition, plus cell index when staggered)."""
    k %= len(arms)
    return list(arms[k:]) + list(arms[:k])


class Raw:
    """Raw measurements: per cell and arm, each metric's values over the kept
    repetitions (with the repetition each came from), and the errors of the
    failed measurements."""

    def __init__(self, cells: Sequence, arms: Sequence[str]):
        self.cells, self.arms = list(cells), list(arms)
        self.values: dict = {c: {a: {} for a in arms} for c in self.cells}  # metric -> [(rep, v)]
        self.errors: dict = {c: {a: [] for a in arms} for c in self.cells}

    def add(self, cell, arm, rep: int, metrics: dict) -> None:
        for name, value in metrics.items():
            self.values[cell][arm].setdefault(name, []).append((rep, value))

    def series(self, cell, arm, metric) -> list:
        return [v for _, v in self.values[cell][arm].get(metric, [])]

    def ok(self, cell, arm) -> int:
        """Repetitions of (cell, arm) that succeeded."""
        return len({r for pairs in self.values[cell][arm].values() for r, _ in pairs})

    def paired(self, cell, arm, baseline, metric) -> list[tuple[float, float]]:
        """(arm value, baseline value) of the repetitions where both have `metric`."""
        mine = dict(self.values[cell][arm].get(metric, []))
        base = dict(self.values[cell][baseline].get(metric, []))
        return [(mine[r], base[r]) for r in sorted(mine) if r in base]

    def as_json(self) -> dict:
        return {"cells": [list(c) if isinstance(c, tuple) else c for c in self.cells],
                "arms": self.arms,
                "values": [[{m: pairs for m, pairs in self.values[c][a].items()} for a in self.arms]
                           for c in self.cells],
                "errors": [[self.errors[c][a] for a in self.arms] for c in self.cells]}

    @classmethod
    def from_json(cls, data: dict) -> Raw:
        cells = [tuple(c) if isinstance(c, list) else c for c in data["cells"]]
        raw = cls(cells, data["arms"])
        for c, per_arm, errs in zip(cells, data["values"], data["errors"]):
            for a, metrics, e in zip(raw.arms, per_arm, errs):
                raw.values[c][a] = {m: [tuple(p) for p in pairs] for m, pairs in metrics.items()}
                raw.errors[c][a] = list(e)
        return raw


class BenchError(RuntimeError):
    """A failed measurement whose message is already the whole story (no type prefix)."""


def error_text(exc: BaseException) -> str:
    """"Type: first line" of an exception (a BenchError: its message), at most 300 chars."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return (first if isinstance(exc, BenchError) else f"{type(exc).__name__}: {first}")[:300]


def interleave(cells: Sequence, arms: Sequence[str], measure: Callable[[object, str, int], dict],
               reps: int, warmup_reps: int = 0, label: str = "", log=None, stagger: bool = False,
               show: Callable[[dict], str] | None = None) -> Raw:
    """Run `measure(cell, arm, rep) -> {metric: value}` for every cell and arm,
    `reps` kept repetitions after `warmup_reps` discarded ones (their `rep` is
    negative); see the module docstring. `show` turns a result into the progress
    line (default: every metric)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    show = show or (lambda m: ", ".join(f"{k}={_short(v)}" for k, v in m.items()))
    raw = Raw(cells, arms)
    total = warmup_reps + reps
    done, count, start = 0, total * len(cells) * len(arms), time.perf_counter()
    for r in range(total):
        rep = r - warmup_reps
        kept = rep >= 0
        tag = f"rep {rep + 1}/{reps}" if kept else f"warm-up {r + 1}/{warmup_reps}"
        for i, cell in enumerate(cells):
            for arm in rotated(arms, r + (i if stagger else 0)):
                t0 = time.perf_counter()
                done += 1
                where = (f"[{done}/{count} {t0 - start:6.1f}s] {label} {tag} cell={cell} "
                         f"arm={arm}")
                try:
                    metrics = measure(cell, arm, rep)
                except Exception as exc:  # a failed arm is a result, not the end of the run
                    error = error_text(exc)
                    log(f"{where}: FAILED {error}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    if kept:
                        raw.errors[cell][arm].append(error)
                    continue
                if kept:
                    raw.add(cell, arm, rep, metrics)
                log(f"{where} ({time.perf_counter() - t0:.1f} s): {show(metrics)}")
    return raw


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------
# summaries: the one formatter

def fmt_num(x: float, spec: str = "auto") -> str:
    """`x` formatted with `spec`; "auto": 3 significant digits-ish (0.123, 1.23, 12.3, 123)."""
    if spec != "auto":
        return format(x, spec)
    ax = abs(x)
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


@dataclass
class Summary:
    median: float
    min: float
    max: float
    n: int

    def fmt(self, spec: str = ".1f", unit: str = "") -> str:
        """"median [min–max]" (unit after the median), the median alone for one value, "–" for none."""
        if self.n == 0:
            return "–"
        if self.n == 1:
            return f"{fmt_num(self.median, spec)}{unit}"
        return (f"{fmt_num(self.median, spec)}{unit} "
                f"[{fmt_num(self.min, spec)}–{fmt_num(self.max, spec)}]")

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}


def summarize(values: Iterable[float]) -> Summary:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return Summary(float("nan"), float("nan"), float("nan"), 0)
    return Summary(statistics.median(values), min(values), max(values), len(values))


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty sequence."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ratio(raw: Raw, cell, arm: str, baseline: str, metric: str) -> Summary:
    """arm / baseline per repetition (paired), summarised."""
    return summarize(a / b for a, b in raw.paired(cell, arm, baseline, metric)
                     if b and a is not None)


def summaries(raw: Raw, metrics: Sequence[str], baseline: str | None = None) -> dict:
    """JSON-ready {cell: {arm: {metric: summary, metric/baseline: ratio summary}}}."""
    out = {}
    for cell in raw.cells:
        out[str(cell)] = {}
        for arm in raw.arms:
            entry = {}
            for m in metrics:
                entry[m] = summarize(raw.series(cell, arm, m)).as_dict()
                if baseline is not None and arm != baseline:
                    entry[f"{m}/{baseline}"] = ratio(raw, cell, arm, baseline, m).as_dict()
            if raw.errors[cell][arm]:
                entry["errors"] = raw.errors[cell][arm]
            out[str(cell)][arm] = entry
    return out


def cell_text(raw: Raw, cell, arm: str, metric: str, spec: str = ".1f") -> str:
    """median [min–max], or FAILED (first error) when no repetition succeeded."""
    s = summarize(raw.series(cell, arm, metric))
    errors = raw.errors[cell][arm]
    if s.n == 0 and errors:
        return f"FAILED ({errors[0][:80]})"
    text = s.fmt(spec)
    if errors:
        text += f" ({len(errors)} failed)"
    return text


def ratio_text(raw: Raw, cell, arm: str, baseline: str, metric: str, spec: str = ".2f") -> str:
    s = ratio(raw, cell, arm, baseline, metric)
    return s.fmt(spec, "×") if s.n else "–"
