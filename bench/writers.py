"""Writers: `markdown_table`, `write_outputs` (the table to stdout and
`--markdown`, numbers plus `environment()` to `--json`), `plot_sweep` /
`plot_bars` / `draw_bars` (PNG through matplotlib's Agg backend; they return
None when matplotlib is not installed).

Nothing here imports torch or matplotlib at import time.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence

from common import Summary


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
