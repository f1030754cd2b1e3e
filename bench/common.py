"""One way of running benchmark arms side by side, summarising and writing them.

Used by bench/workers.py, bench/payload.py, bench/train.py and bench/run_all.py.

Method (what `interleave` guarantees):
  * every cell (one point of a sweep: a worker count, a payload size, ...) runs
    every arm once per repetition, back to back, so arms compared with each
    other ran seconds apart on the same machine state;
  * the arm order is rotated from one repetition to the next (no arm always
    goes first, nor always follows the same neighbour);
  * `warmup_reps` whole repetitions run first and are thrown away (imports,
    page cache, allocator and CPU-frequency warm-up); benches also exclude
    warm-up batches inside each measurement;
  * a measurement that raises is recorded as FAILED with its error, and the
    run goes on.
Summaries are median [min–max] over the kept repetitions. Ratios to a baseline
arm are computed per repetition between the two arms measured side by side
(paired), then summarised the same way. On a shared 2-core machine absolute
numbers are noise; ratios measured in one run are the figures.

Writers: `markdown_table`, `write_json` (numbers plus `environment()`), and
`plot_sweep` / `plot_bars` (PNG through matplotlib's Agg backend; they return
None when matplotlib is not installed).

Loader helpers: `measure_loader` (warm-up batches, then timed `next()` +
`del` per batch: wall time, the main thread's CPU time, the CPU time of the
main process and of the workers over the timed window, throughput) and
`wait_clean` (no child process and no shared-memory name of this process left).
"""
from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS = os.path.join(REPO, "results")
SHM_DIR = "/dev/shm"


# ---------------------------------------------------------------------------
# running arms

def rotated(arms: Sequence[str], rep: int) -> list[str]:
    """`arms` rotated left by `rep` (repetition r starts with arm r mod len)."""
    k = rep % len(arms)
    return list(arms[k:]) + list(arms[:k])


class Raw:
    """Raw measurements: values[cell][arm][metric] -> list over kept repetitions,
    and errors[cell][arm] -> list of error strings (one per failed measurement)."""

    def __init__(self, cells: Sequence, arms: Sequence[str]):
        self.cells, self.arms = list(cells), list(arms)
        self.values = {c: {a: {} for a in arms} for c in self.cells}
        self.errors = {c: {a: [] for a in arms} for c in self.cells}
        self.reps: dict = {c: {a: [] for a in arms} for c in self.cells}  # rep index per value

    def add(self, cell, arm, rep: int, metrics: dict) -> None:
        for name, value in metrics.items():
            self.values[cell][arm].setdefault(name, []).append(value)
        self.reps[cell][arm].append(rep)

    def series(self, cell, arm, metric) -> list:
        return self.values[cell][arm].get(metric, [])

    def paired(self, cell, arm, baseline, metric) -> list[tuple[float, float]]:
        """(arm value, baseline value) of the repetitions where both succeeded."""
        mine = dict(zip(self.reps[cell][arm], self.series(cell, arm, metric)))
        base = dict(zip(self.reps[cell][baseline], self.series(cell, baseline, metric)))
        return [(mine[r], base[r]) for r in sorted(mine) if r in base]

    def as_json(self) -> dict:
        return {str(c): {"values": self.values[c], "errors": self.errors[c], "reps": self.reps[c]}
                for c in self.cells}


def interleave(cells: Sequence, arms: Sequence[str], measure: Callable[[object, str], dict],
               reps: int, warmup_reps: int = 0, label: str = "", log=None) -> Raw:
    """Run `measure(cell, arm) -> {metric: number}` for every cell and arm, `reps`
    kept repetitions after `warmup_reps` discarded ones; see the module docstring."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    raw = Raw(cells, arms)
    total = warmup_reps + reps
    for r in range(total):
        kept = r >= warmup_reps
        tag = f"rep {r - warmup_reps + 1}/{reps}" if kept else f"warm-up {r + 1}/{warmup_reps}"
        for cell in cells:
            for arm in rotated(arms, r):
                t0 = time.perf_counter()
                try:
                    metrics = measure(cell, arm)
                except Exception as exc:  # a failed arm is a result, not the end of the run
                    error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
                    log(f"{label} {tag} cell={cell} arm={arm}: FAILED {error}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    if kept:
                        raw.errors[cell][arm].append(error)
                    continue
                if kept:
                    raw.add(cell, arm, r - warmup_reps, metrics)
                shown = ", ".join(f"{k}={_short(v)}" for k, v in metrics.items())
                log(f"{label} {tag} cell={cell} arm={arm} ({time.perf_counter() - t0:.1f} s): {shown}")
    return raw


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------
# summaries

@dataclass
class Summary:
    median: float
    min: float
    max: float
    n: int

    def fmt(self, spec: str = ".1f", unit: str = "") -> str:
        if self.n == 0:
            return "–"
        if self.n == 1:
            return f"{self.median:{spec}}{unit}"
        return f"{self.median:{spec}}{unit} [{self.min:{spec}}–{self.max:{spec}}]"

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}


def summarize(values: Iterable[float]) -> Summary:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return Summary(float("nan"), float("nan"), float("nan"), 0)
    return Summary(statistics.median(values), min(values), max(values), len(values))


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


def plot_sweep(path: str, xs: Sequence, series: dict[str, Sequence[Summary]], *, xlabel: str,
               ylabel: str, title: str, ratios: dict[str, Sequence[Summary]] | None = None,
               ratio_label: str = "ratio", logx: bool = False, logy: bool = False) -> str | None:
    """Medians with min–max error bars per arm against `xs`; with `ratios`, a second
    panel of paired ratios (log scale: 2× and 0.5× are equally far from 1).
    Returns `path`, or None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(path: str, groups: Sequence[str], series: dict[str, Sequence[Summary]], *,
              ylabel: str, title: str, curves: dict[str, Sequence[float]] | None = None,
              curves_label: str = "", curves_xlabel: str = "step") -> str | None:
    """Grouped bars (median, min–max error bars) per arm for each group; with
    `curves`, a second panel of line plots (e.g. loss per step per arm).
    Returns `path`, or None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot {path}", file=sys.stderr)
        return None
    panels = 2 if curves else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(1, len(series))
    for k, (name, points) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        med = [s.median if s.n else 0.0 for s in points]
        err = [[s.median - s.min if s.n else 0.0 for s in points],
               [s.max - s.median if s.n else 0.0 for s in points]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    if curves:
        ax = axes[0][1]
        styles = ["-", "--", ":", "-."]
        for k, (name, values) in enumerate(curves.items()):
            ax.plot(range(1, len(values) + 1), values, styles[k % len(styles)], label=name)
        ax.set_xlabel(curves_xlabel)
        ax.set_ylabel(curves_label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_output_args(parser, name: str) -> None:
    """--quick, --reps, --warmup-reps, --out DIR, --json/--markdown/--plot PATH."""
    parser.add_argument("--quick", action="store_true", help="short run (run_all --quick)")
    parser.add_argument("--reps", type=int, default=None, help="kept repetitions (default 5, quick 3)")
    parser.add_argument("--warmup-reps", type=int, default=None,
                        help="discarded repetitions first (default 1, quick 0)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help=f"write {name}.md, {name}.json and {name}.png into DIR")
    parser.add_argument("--json", metavar="PATH", help="write raw numbers and summaries")
    parser.add_argument("--markdown", metavar="PATH", help="write the table")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")


def resolve_outputs(args, name: str) -> None:
    args.reps = args.reps or (3 if args.quick else 5)
    if args.warmup_reps is None:
        args.warmup_reps = 0 if args.quick else 1
    if args.out:
        args.json = args.json or os.path.join(args.out, f"{name}.json")
        args.markdown = args.markdown or os.path.join(args.out, f"{name}.md")
        args.plot = args.plot or os.path.join(args.out, f"{name}.png")


# ---------------------------------------------------------------------------
# loaders

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


def _worker_pids(it) -> list[int]:
    # DataLoader's and PoolLoader's iterators both keep their processes in `_workers`.
    return [w.pid for w in getattr(it, "_workers", ()) if w.pid]


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
        workers = _worker_pids(it)
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


def our_shm_names() -> list[str]:
    """Names in /dev/shm that carry this process's pid (poolloader's `pl2-<pid>-`,
    torch's `torch_<pid>_`)."""
    from poolloader.pool import NAME_TAG

    pid = os.getpid()
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith((f"{NAME_TAG}-{pid}-", f"torch_{pid}_")))


def wait_clean(timeout: float = 10.0) -> list[str]:
    """Wait until no multiprocessing child is alive and no shm name of ours is
    left; returns what is still there after `timeout` (empty when clean)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        children = multiprocessing.active_children()  # also reaps the exited ones
        names = our_shm_names()
        if not children and not names:
            return []
        if time.monotonic() > deadline:
            return [f"child pid {c.pid}" for c in children] + [f"{SHM_DIR}/{n}" for n in names]
        time.sleep(0.05)


# ---------------------------------------------------------------------------
# data

def coco_like_data(images: int, seed: int, root: str | None = None) -> tuple[str, str]:
    """(root, annotation file) of the cached synthetic JPEG data set."""
    from poolloader.synthetic import cached_coco_like

    return cached_coco_like(images, seed, root)


