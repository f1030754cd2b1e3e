"""Reading LoaderStats: which side is the bottleneck, and what to change.

Every statement quotes the measured numbers it rests on, and none goes further than
they do. The shares are of the steady state (LoaderStats.iter_s: from each epoch's
first batch to its last), so worker start-up does not read as slow workers:

    wait share     steady_wait_s / iter_s   main blocked in next() for a worker
    busy share     worker_busy_s / (worker_busy_s + worker_idle_s), over all workers
    hand-off share (next_s - steady_wait_s) / iter_s: next() apart from waiting
                   (taking the slot, decoding views; CUDA staging with device=)

Verdicts:
    workers     wait share >= WAIT_BOUND and busy share >= BUSY_BOUND: add workers
                (if the cores allow) or cheapen __getitem__/collate
    uneven      wait share >= WAIT_BOUND, busy share below BUSY_BOUND: main waits
                while workers have spare time: particular batches are slow
    consumer    wait share < WAIT_BOUND, busy share < IDLE_BELOW: the training step is
                the bottleneck and fewer workers would do
    balanced    wait share < WAIT_BOUND, busy share >= IDLE_BELOW: keeps up, keep it
    unmeasured  fewer than MIN_BATCHES steady-state batches
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

WAIT_BOUND = 0.10    # main waited this share of the steady state or more: the loader holds it back
BUSY_BOUND = 0.80    # workers busy this share or more: no spare worker time
IDLE_BELOW = 0.50    # workers busy less than this: more workers than the step needs
HANDOFF_SMALL = 0.10  # a hand-off under this share of step time is not worth optimising
STARTUP_SHOWN = 0.10  # start-up at least this share of the time measured is mentioned
MIN_BATCHES = 5


@dataclass
class Advice:
    """`verdict` (see the module doc), `statements` (each with its numbers), and the
    measured `shares`/figures they rest on."""

    verdict: str
    statements: list[str] = field(default_factory=list)
    shares: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n".join(self.statements)

    def __str__(self) -> str:
        return self.text


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def advise(stats, cores: int | None = None) -> Advice:
    """The advice for `stats` (a LoaderStats); `cores`: usable cores (default: this
    process's CPU affinity)."""
    cores = usable_cores() if cores is None else cores
    n, span = stats.steady_batches, stats.iter_s
    if n < MIN_BATCHES or span <= 0:
        return Advice("unmeasured", [
            f"too few batches measured to advise ({n} after each epoch's first; "
            f"{MIN_BATCHES} needed)"])
    busy, idle = stats.worker_busy_s, stats.worker_idle_s
    wait = min(max(stats.steady_wait_s, 0.0), span)
    handoff = min(max(stats.next_s - stats.steady_wait_s, 0.0), span)
    w_share, h_share = wait / span, handoff / span
    b_share = busy / (busy + idle) if busy + idle > 0 else 0.0
    m = stats.num_workers
    per_batch_ms = 1e3 * span / n
    worker_ms = 1e3 * busy / stats.worker_batches if stats.worker_batches else 0.0
    # the training step: time per batch that main spent outside next()
    step_ms = 1e3 * max(span - stats.next_s, 0.0) / n
    shares = {"main_wait": w_share, "worker_busy": b_share, "handoff": h_share,
              "batch_ms": per_batch_ms, "worker_batch_ms": worker_ms, "step_ms": step_ms,
              "num_workers": float(m), "cores": float(cores)}
    said = []
    if w_share >= WAIT_BOUND and b_share >= BUSY_BOUND:
        verdict = "workers"
        line = (f"main waited {_pct(w_share)} of the epoch for workers, workers were busy "
                f"{_pct(b_share)}: the workers are the bottleneck (a batch costs a worker "
                f"{worker_ms:.1f} ms, the training step {step_ms:.1f} ms); ")
        if m < cores:
            need = math.ceil(worker_ms / step_ms) if step_ms > 0 else None
            more = f" (about {need} keep up)" if need is not None and m < need <= cores else ""
            line += (f"add workers: num_workers={m}, you have {cores} cores{more}; "
                     "or make __getitem__/collate cheaper")
        else:
            line += (f"num_workers={m} already matches the {cores} cores you have: make "
                     "__getitem__/collate cheaper (more workers help only if it waits on "
                     "I/O rather than computing)")
        said.append(line)
    elif w_share >= WAIT_BOUND:
        verdict = "uneven"
        said.append(
            f"main waited {_pct(w_share)} of the epoch, yet workers were busy only "
            f"{_pct(b_share)}: main waits on particular batches while other workers have "
            f"time to spare (uneven sample cost, or one slow worker); a larger "
            "prefetch_factor gets more batches ready ahead, in_order=False lets ready "
            "batches overtake a slow one")
    elif b_share < IDLE_BELOW:
        verdict = "consumer"
        fewer = max(1, math.ceil(m * b_share / BUSY_BOUND))
        line = (f"workers were idle {_pct(1 - b_share)} and main waited only "
                f"{_pct(w_share)} in the steady state: the training step is the bottleneck "
                f"({step_ms:.1f} ms per batch, a worker needs {worker_ms:.1f} ms)")
        if fewer < m:
            line += (f"; fewer workers would do: with num_workers={fewer} instead of {m} "
                     f"they would be busy about {_pct(m * b_share / fewer)} (to keep "
                     f"num_workers={m}'s batches: node_workers={fewer} processes, or "
                     f"node_workers=\"auto\", which chooses as it runs)")
        said.append(line)
    else:
        verdict = "balanced"
        spare = "little to spare: fewer workers would make main wait" \
            if b_share >= BUSY_BOUND else f"{_pct(1 - b_share)} of worker time to spare"
        said.append(
            f"main waited only {_pct(w_share)} in the steady state and workers were busy "
            f"{_pct(b_share)}: the loader keeps up with the training step with {spare}; keep num_workers={m}")
    if h_share < HANDOFF_SMALL:
        said.append(f"the hand-off is {_pct(h_share)} of step time "
                    f"({1e3 * handoff / n:.2f} ms per batch): pinning/packing would not help")
    else:
        said.append(f"the hand-off is {_pct(h_share)} of step time "
                    f"({1e3 * handoff / n:.2f} ms per batch): it grows with the number of "
                    "tensors in a batch, not their bytes: if a batch carries many small "
                    "tensors, packing them into a few (poolloader.pack_targets) cuts it")
    total = stats.startup_s + span
    if total > 0 and stats.startup_s / total >= STARTUP_SHOWN:
        said.append(f"start-up (each epoch's start to its first batch) took "
                    f"{stats.startup_s:.1f} s, {_pct(stats.startup_s / total)} of the time "
                    "measured, not counted above; without persistent_workers=True every "
                    "epoch starts its workers again")
    return Advice(verdict, said, shares)
