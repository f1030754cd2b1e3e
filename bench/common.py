"""The one benchmark runner: every bench/*.py parses, runs, summarises and writes through it.

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

Writers: `markdown_table`, `write_outputs` (the table to stdout and
`--markdown`, numbers plus `environment()` to `--json`), `plot_sweep` /
`plot_bars` / `draw_bars` (PNG through matplotlib's Agg backend; they return
None when matplotlib is not installed).

/proc (`fd_count`, `cpu_ns`, `rss_bytes`, `shm_mapped_bytes`, `processes`,
`live_children`, `session_pids`, `pids_running`) and hygiene (`note_workers`,
`our_shm_names`, `wait_clean`): one reader of the process table for all benches.

Baselines: `baseline_tree` / `remove_baseline_tree` (a git revision of this
repository in a worktree, importable by a child process).

Loaders: `measure_loader` (warm-up batches, then timed `next()` + `del` per
batch: wall time, the main thread's CPU time, the CPU time of the main process
and of the workers over the timed window, throughput), `shutdown_iterator`.

Data: the one RF-DETR-shaped fake data set (`RFDETRShaped`: batch of 16, per
sample an image, a padding mask and RF-DETR's 7 target tensors, built from
precomputed tensors so workers are cheap) and its collate (`RFDETRCollate`:
what crosses the boundary is one of `ROWS`, allocated where each loader wants
it), plus `coco_like_data` (real JPEGs from fixtures/).

Nothing here imports torch or poolloader at import time (bench/fd_limits.py
sets its descriptor limit before either is loaded).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
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
SHM_DIR = "/dev/shm"


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
# running arms

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
    return summarize(a / b for a, b in raw.paired(cell, arm, baseline, metric) if b)


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


# ---------------------------------------------------------------------------
# writers

def markdown_table(headers: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A GitHub Markdown table; `align` one of l/r/c per column (default: first l, rest r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(v) for v in row) + " |")
    return "\n".join(lines)


def environment() -> dict:
    import torch
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "start_method": multiprocessing.get_start_method(allow_none=True) or "default",
        "argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg": os.getloadavg(),
    }


def env_line() -> str:
    env = environment()
    return (f"{env['cpus']} CPUs, Python {env['python']}, torch {env['torch']}, "
            f"{env['platform']}")


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=2, default=str)
        f.write("\n")
    return path


def write_text(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")
    return path


def write_outputs(args, text: str, payload: dict | None = None) -> None:
    """Print `text`; write it to --markdown and `payload` (plus the config and
    the environment) to --json when asked."""
    print(text)
    if args.markdown:
        write_text(args.markdown, text)
    if args.json:
        write_json(args.json, {"bench": args.bench, "config": vars(args), **(payload or {})})


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, plt, path: str) -> str:
    """Lay out, write `path` (PNG, folders created) and close `fig`."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(path: str, xs: Sequence, series: dict[str, Sequence[Summary]], *, xlabel: str,
               ylabel: str, title: str, ratios: dict[str, Sequence[Summary]] | None = None,
               ratio_label: str = "ratio", logx: bool = False, logy: bool = False) -> str | None:
    """Medians with min–max error bars per arm against `xs`; with `ratios`, a second
    panel of paired ratios (log scale: 2× and 0.5× are equally far from 1).
    Returns `path`, or None if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        print(f"matplotlib not installed: no plot {path}", file=sys.stderr)
        return None
    panels = 2 if ratios else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.2), squeeze=False)

    def draw(ax, data, ylab, log_y, base=10):
        for name, points in data.items():
            good = [(x, s) for x, s in zip(xs, points) if s.n]
            if not good:
                continue
            gx = [x for x, _ in good]
            med = [s.median for _, s in good]
            err = [[s.median - s.min for _, s in good], [s.max - s.median for _, s in good]]
            ax.errorbar(gx, med, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylab)
        if logx:
            ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log", base=base)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)

    draw(axes[0][0], series, ylabel, logy)
    axes[0][0].set_title(title, fontsize=10)
    if ratios:
        draw(axes[0][1], ratios, ratio_label + " (log scale)", True)
        axes[0][1].axhline(1.0, color="grey", lw=0.8, ls="--")
        axes[0][1].set_title("paired ratio per repetition, median [min–max]", fontsize=10)
    return save_figure(fig, plt, path)


def draw_bars(ax, groups: Sequence[str], series: dict[str, Sequence[Summary]], *, ylabel: str,
              title: str, log: bool = False, rotation: int = 0) -> None:
    """Grouped bars (median, min–max error bars) per series for each group, on `ax`."""
    width = 0.8 / max(1, len(series))
    for k, (name, points) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        good = [(x, s) for x, s in zip(xs, points) if s.n]
        ax.bar([x for x, _ in good], [s.median for _, s in good], width,
               yerr=[[s.median - s.min for _, s in good], [s.max - s.median for _, s in good]],
               capsize=3, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=rotation, fontsize=8 if rotation else None)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def plot_bars(path: str, groups: Sequence[str], series: dict[str, Sequence[Summary]], *,
              ylabel: str, title: str, curves: dict[str, Sequence[float]] | None = None,
              curves_label: str = "", curves_xlabel: str = "step") -> str | None:
    """`draw_bars` in one panel; with `curves`, a second panel of line plots (e.g.
    loss per step per arm). Returns `path`, or None if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        print(f"matplotlib not installed: no plot {path}", file=sys.stderr)
        return None
    panels = 2 if curves else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.2), squeeze=False)
    draw_bars(axes[0][0], groups, series, ylabel=ylabel, title=title)
    if curves:
        ax = axes[0][1]
        styles = ["-", "--", ":", "-."]
        for k, (name, values) in enumerate(curves.items()):
            ax.plot(range(1, len(values) + 1), values, styles[k % len(styles)], label=name)
        ax.set_xlabel(curves_xlabel)
        ax.set_ylabel(curves_label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    return save_figure(fig, plt, path)


# ---------------------------------------------------------------------------
# /proc: the one reader

@dataclass
class Proc:
    state: bytes
    ppid: int
    pgrp: int
    session: int


def processes() -> dict[int, Proc]:
    """{pid: Proc} of every process readable now (one that exits meanwhile is skipped)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        table[int(entry)] = Proc(fields[0], int(fields[1]), int(fields[2]), int(fields[3]))
    return table


def _alive(proc: Proc) -> bool:
    return proc.state not in (b"Z", b"X", b"x")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def live_children(pid: int | None = None) -> dict[int, str]:
    """{pid: command line} of the non-zombie children of `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return {p: cmdline(p) for p, proc in processes().items() if proc.ppid == pid and _alive(proc)}


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `sid`."""
    return [p for p, proc in processes().items() if proc.session == sid and _alive(proc)]


def pids_running(needle: str) -> list[int]:
    """Processes whose command line contains `needle` (read-only)."""
    return sorted(p for p in processes() if needle in cmdline(p))


def fd_count(pid: int | str = "self") -> int:
    """Open descriptors of `pid`, not counting the one this call opens to list them."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return fds - 1 if pid in ("self", os.getpid()) else fds


def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of `pid`, in ns (/proc/<pid>/task/*/schedstat).

    Threads that exited are not counted (loader workers keep theirs for life)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of `pid` (/proc/<pid>/statm)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shm_mapped_bytes(pid: int | str = "self") -> int:
    """Bytes of shared memory objects that `pid` maps: /dev/shm files (unlinked ones
    included) and memfd segments (poolloader's default backend), each (object, offset,
    length) counted once: the shared memory it keeps alive."""
    seen = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith((SHM_DIR + "/", "/memfd:")):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            seen.add((parts[3], parts[4], int(parts[2], 16), end - start))
    return sum(length for *_, length in seen)


# pids of this run and of every worker it started: /dev/shm names are ours when
# they carry one (PoolLoader: "pl2-<main pid>-...", torch: "torch_<creator pid>_...").
# Other processes on the machine may create and remove names meanwhile.
OUR_PIDS = {os.getpid()}


def note_workers(it) -> list[int]:
    """Remember the worker pids of a loader iterator (DataLoader's and PoolLoader's
    both keep their processes in `_workers`); returns them."""
    pids = [w.pid for w in getattr(it, "_workers", ()) if w.pid]
    OUR_PIDS.update(pids)
    return pids


def shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def names_of(pids, names=None) -> list[str]:
    """The /dev/shm names (of `names`, default all) that carry one of `pids`
    (as `pl2-<pid>-` or `torch_<pid>_`)."""
    from poolloader.shm.backends.posix import NAME_TAG

    pids = set(pids)
    out = []
    for name in shm_names() if names is None else names:
        for prefix, sep in ((f"{NAME_TAG}-", "-"), ("torch_", "_")):
            if name.startswith(prefix):
                head = name[len(prefix):].split(sep, 1)[0]
                if head.isdigit() and int(head) in pids:
                    out.append(name)
    return sorted(out)


def our_shm_names() -> list[str]:
    return names_of(OUR_PIDS)


def _service_pids() -> set[int]:
    """multiprocessing's run-long helper processes (resource tracker, forkserver), if started."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {pid for pid in pids if pid}


def wait_no_children(timeout: float = 10.0) -> dict[int, str]:
    """Wait until this process has no live child (multiprocessing's resource tracker
    and forkserver excepted); returns those left after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        multiprocessing.active_children()  # reaps the multiprocessing children that exited
        services = _service_pids()
        children = {p: c for p, c in live_children().items() if p not in services}
        if not children or time.monotonic() > deadline:
            return children
        time.sleep(0.05)


def wait_clean(timeout: float = 10.0) -> list[str]:
    """Wait until no child process and no shm name of ours is left; returns what
    is still there after `timeout` (empty when clean)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        children = wait_no_children(0)
        names = our_shm_names()
        if not children and not names:
            return []
        if time.monotonic() > deadline:
            return [f"child pid {p}" for p in children] + [f"{SHM_DIR}/{n}" for n in names]
        time.sleep(0.05)


# ---------------------------------------------------------------------------
# another revision of this repository, side by side

def baseline_tree(rev: str, where: str) -> str:
    """A worktree of git revision `rev` at `where`/baseline, importable: its compiled
    modules are copied from this tree when their sources are the same, else built there.
    Children started with PYTHONPATH=<tree> import its poolloader (this module puts the
    repository first on sys.path: a child must import it before moving <tree> in front).
    Remove it with `remove_baseline_tree(where)`."""
    tree = os.path.join(where, "baseline")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", tree, rev], check=True)
    # the compiled modules live in poolloader/shm/; a revision from before that layout
    # (or with other sources) is built in its own tree
    same = subprocess.run(["git", "-C", REPO, "diff", "--quiet", rev, "--", "poolloader/shm/_ring.pyx",
                           "poolloader/shm/_shm.pyx", "csrc", "setup.py"]).returncode == 0
    same = same and os.path.isdir(os.path.join(tree, "poolloader", "shm"))
    built = [f for f in os.listdir(os.path.join(REPO, "poolloader", "shm")) if f.endswith(".so")]
    if same and built:
        for f in built:
            shutil.copy2(os.path.join(REPO, "poolloader", "shm", f),
                         os.path.join(tree, "poolloader", "shm", f))
    else:
        build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=tree,
                               capture_output=True, text=True)
        if build.returncode:
            tail = "\n".join((build.stderr or build.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"building the compiled modules of {rev} in {tree} failed "
                               f"(setup.py build_ext --inplace, exit {build.returncode}):\n{tail}")
    return tree


def remove_baseline_tree(where: str) -> None:
    """Undo `baseline_tree(rev, where)`: unregister the worktree and delete all of
    `where`; failures are ignored (a run that failed half-way still cleans up)."""
    subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", os.path.join(where, "baseline")],
                   capture_output=True)
    shutil.rmtree(where, ignore_errors=True)


# one arm in a fresh interpreter (bench/throughput.py, bench/memory.py): the script runs
# itself with `--child JSON`, the child measures and prints one JSON line

SKIPPED = "skipped"  # the key a child prints instead of figures when its arm cannot run here


def use_tree(tree: str) -> None:
    """In an arm's child: put `tree` (this repository or a `baseline_tree`) first on
    sys.path in this repository's place; call it before importing poolloader."""
    if tree != REPO:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != REPO]
        sys.path.insert(0, tree)


def check_tree(module, tree: str) -> None:
    """In an arm's child: exit saying so unless `module` (poolloader) came from `tree`."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))
    if where != tree:
        raise SystemExit(f"imported {module.__name__} from {where}, not from {tree}")


def arm_leftovers(names0: set[str], pids: Iterable[int], timeout: float = 10.0) -> list[str]:
    """In an arm's child, after its loader shut down: what the arm left, waiting at most
    `timeout` s for it to go. Live children (multiprocessing's resource tracker and
    forkserver excepted) and the /dev/shm names that appeared since `names0` carrying
    this process's pid or one of `pids` (poolloader's POSIX names and torch's both do;
    found by token, so nothing of either tree is imported)."""
    ours = {str(os.getpid())} | {str(p) for p in pids}
    deadline = time.monotonic() + timeout
    while True:
        children = wait_no_children(0)
        names = sorted(x for x in shm_names() - names0 if ours & set(x.replace("_", "-").split("-")))
        if (not children and not names) or time.monotonic() > deadline:
            return [f"child pid {c}" for c in children] + [f"{SHM_DIR}/{x}" for x in names]
        time.sleep(0.05)


def run_arm(script: str, spec: dict, timeout: float) -> dict:
    """Run one arm: `script --child JSON(spec)` in a fresh interpreter importing
    `spec["tree"]`, in its own session; past `timeout` the whole session (the arm and its
    workers) is killed, so nothing runs into the next arm. Returns the child's last JSON
    line less its `left` list; raises BenchError when the arm ran too long, failed, left
    something behind (`left`, from `arm_leftovers`) or printed `SKIPPED` (with why)."""
    env = dict(os.environ, PYTHONPATH=spec["tree"])
    proc = subprocess.Popen([sys.executable, script, "--child", json.dumps(spec)], cwd=spec["tree"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, stderr = proc.communicate(timeout=30)
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise BenchError(f"arm {spec['arm']} ran past {timeout:.0f} s (killed); "
                         f"its stderr ended: {tail or '(nothing)'}") from None
    if proc.returncode:
        raise BenchError(f"arm {spec['arm']} exited {proc.returncode}: "
                         f"{(stderr.strip().splitlines() or [''])[-1]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    if SKIPPED in result:
        raise BenchError(f"{SKIPPED}: {result[SKIPPED]}")
    left = result.pop("left")
    if left:
        raise BenchError(f"arm {spec['arm']} left behind: {', '.join(left)}")
    return result


# ---------------------------------------------------------------------------
# loaders

def measure_loader(loader, warmup_batches: int, batches: int, images_per_batch: int) -> dict:
    """Iterate `loader` once: `warmup_batches` untimed, then `batches` timed.

    Per timed batch: wall time of `next()` and of `del batch`, and the main
    thread's CPU time over both (`time.thread_time`: the main-process cost of
    receiving and releasing a batch, without the time spent blocked waiting for
    a worker; a loader that spins while waiting is charged for the spin).
    Over the timed window: CPU time of the main process (all threads) and of
    the workers (all threads), per batch, from /proc schedstat: what the whole
    pipeline costs the machine, which a busy machine inflates far less than
    wall time. Throughput: images over the wall time of the timed batches (the
    consumer does nothing else, so this is the loader's own rate). The iterator
    is shut down before returning, and a PoolLoader's `stats` are read before that.
    The dataset should hold more than warmup_batches + batches batches, so the
    timed ones do not come from a draining pipeline.
    """
    it = iter(loader)
    try:
        for _ in range(warmup_batches):
            batch = next(it)
            del batch
        stats0 = loader.stats.as_dict() if hasattr(loader, "stats") else None
        workers = note_workers(it)
        next_ms, del_ms, cpu_ms = [], [], []
        main0 = cpu_ns(os.getpid())
        workers0 = sum(cpu_ns(pid) for pid in workers)
        start = time.perf_counter()
        for _ in range(batches):
            c0, t0 = time.thread_time(), time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            del batch
            t2 = time.perf_counter()
            cpu_ms.append((time.thread_time() - c0) * 1e3)
            next_ms.append((t1 - t0) * 1e3)
            del_ms.append((t2 - t1) * 1e3)
        wall = time.perf_counter() - start
        main_total = cpu_ns(os.getpid()) - main0
        workers_total = sum(cpu_ns(pid) for pid in workers) - workers0
        stats = loader.stats.as_dict() if hasattr(loader, "stats") else None
    finally:
        shutdown_iterator(it)
        del it
    out = {
        "img_s": images_per_batch * batches / wall,
        "batch_s": batches / wall,
        "main_cpu_ms": statistics.median(cpu_ms),
        "next_ms": statistics.median(next_ms),
        "del_ms": statistics.median(del_ms),
        "wait_share": sum(next_ms) / 1e3 / wall,
        "main_proc_cpu_ms": main_total / 1e6 / batches,
        "worker_cpu_ms": workers_total / 1e6 / batches,
        "total_cpu_ms": (main_total + workers_total) / 1e6 / batches,
    }
    if stats is not None:
        out["slot_growths_timed"] = stats["slot_growths"] - stats0["slot_growths"]
        out["slot_mib"] = stats["slot_bytes"] / 2**20
    return out


def shutdown_iterator(it) -> None:
    """Stop a loader iterator's workers now (DataLoader's and PoolLoader's both
    have `_shutdown_workers`; otherwise rely on garbage collection)."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
    gc.collect()


# ---------------------------------------------------------------------------
# data: the RF-DETR batch shape

BATCH = 16
RESOLUTION = 576
MAX_INSTANCES = 14  # n uniform in 0..14: mean 7, about 1 sample in 15 empty

# What crosses the worker -> main boundary (the collate's output; same data set).
ROWS = [
    ("count", "(a) batch size only"),
    ("image_mask", "(b) image + mask"),
    ("packed", "(c) + packed targets"),
    ("per_sample", "(d) + per-sample targets"),
]
ROW_LABEL = dict(ROWS)


def make_target(rng: random.Random, image_id: int, resolution: int = RESOLUTION,
                orig_hw=(480, 640)) -> dict:
    """RF-DETR's 7 target fields and dtypes, n uniform in 0..MAX_INSTANCES (may be 0)."""
    import torch

    n = rng.randint(0, MAX_INSTANCES)
    boxes = torch.tensor([[rng.random() for _ in range(4)] for _ in range(n)],
                         dtype=torch.float32).reshape(n, 4)
    return {
        "boxes": boxes,
        "labels": torch.tensor([rng.randrange(1, 91) for _ in range(n)], dtype=torch.int64),
        "image_id": torch.tensor([image_id], dtype=torch.int64),
        "area": boxes[:, 2] * boxes[:, 3] * float(resolution * resolution),
        "iscrowd": torch.zeros(n, dtype=torch.int64),
        "orig_size": torch.tensor(list(orig_hw), dtype=torch.int64),
        "size": torch.tensor([resolution, resolution], dtype=torch.int64),
    }


class RFDETRShaped:
    """`(image f32 [3,R,R], mask bool [R,R], target)` from precomputed tensors.

    The hand-off, not the worker, costs: the image and mask are returned as
    they are (collate copies them into the batch); the target's 7 tensors are
    cloned, as a real dataset builds fresh ones per sample. `distinct_images`
    random images and `distinct_targets` targets (`make_target`) are cycled;
    deterministic in (seed, index). Map-style without subclassing torch's
    Dataset, so this module imports without torch.
    """

    def __init__(self, length: int, resolution: int = RESOLUTION, seed: int = 0,
                 distinct_images: int = 4, distinct_targets: int = 64):
        import torch

        self.length = length
        g = torch.Generator().manual_seed(seed)
        self.images = [torch.rand(3, resolution, resolution, generator=g)
                       for _ in range(distinct_images)]
        self.mask = torch.zeros(resolution, resolution, dtype=torch.bool)
        rng = random.Random(seed)
        self.targets = [make_target(rng, i, resolution) for i in range(distinct_targets)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} items")
        return (self.images[index % len(self.images)], self.mask,
                {k: v.clone() for k, v in self.targets[index % len(self.targets)].items()})


def _shared_empty(shape, dtype):
    """In a DataLoader worker: a tensor straight in a shared segment, as
    default_collate allocates (no copy at pickling). Elsewhere torch.empty."""
    import torch
    from torch.utils.data import get_worker_info

    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    elem = torch.empty(0, dtype=dtype)
    storage = elem._typed_storage()._new_shared(math.prod(shape), device=elem.device)
    return elem.new(storage).resize_(*shape)


class RFDETRCollate:
    """Collate `RFDETRShaped` samples into what crosses the boundary for `row`
    (see ROWS): the big tensors are allocated where `pool` (PoolLoader:
    `poolloader.slot_empty`, straight into the slot) or DataLoader (a shared
    segment, as default_collate does in a worker) wants them; targets are
    packed with `poolloader.pack_targets` ("packed") or kept as the 16 dicts
    ("per_sample")."""

    def __init__(self, row: str, pool: bool):
        if row not in ROW_LABEL:
            raise ValueError(f"unknown row {row!r}; choose from {list(ROW_LABEL)}")
        self.row, self.pool = row, pool

    def _empty(self, shape, dtype):
        if self.pool:
            from poolloader import slot_empty
            return slot_empty(shape, dtype)
        return _shared_empty(shape, dtype)

    def __call__(self, samples):
        import torch

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
            from poolloader import pack_targets
            return images, mask, pack_targets(targets)
        return images, mask, tuple(targets)


def tensors_in(obj) -> list:
    """Every tensor reachable in a batch (PackedTargets: its fields and counts)."""
    import torch

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


def coco_like_data(images: int, seed: int, root: str | None = None) -> tuple[str, str]:
    """(root, annotation file) of the synthetic JPEG data set, from this user's
    verified cache (or `root`); see fixtures/synthetic.py."""
    from fixtures.synthetic import cached_coco_like

    return cached_coco_like(images, seed, root)
