"""PoolLoader(node_workers="auto"): how many processes host the num_workers logical
workers, chosen again before each epoch from what the epoch before measured.

Why the batches cannot change: the num_workers logical workers fix them (each its
seed, RNG states, dataset copy and iterator; poolloader.worker.loop), and which process
hosts a logical worker changes none of that (`node_workers=P`). So the count may move
between epochs with every batch still DataLoader(num_workers)'s.

What it reads, per epoch, from the loader's own counters (poolloader.main.stats): the
steady state's wall time (`iter_s`: first batch to last), the share of it next() spent
waiting for a worker (`steady_wait_s`), the seconds the workers spent producing
batches (`worker_busy_s`), and, as each epoch's workers stop, their memory (USS).

The rule, with room between its two thresholds so that it never oscillates:
  * one process more when main waited RAISE_AT (10%) of the epoch or more: the
    workers were the bottleneck;
  * one process fewer when main waited LOWER_AT (2%) or less and the work the
    processes did (busy seconds) would keep one process fewer at most FILL (75%)
    busy: they were not;
  * never outside 1 .. the budget: num_workers, the CPUs this process may use
    (sched_getaffinity, the cgroup's CPU quota), and as many processes as half the
    memory available (the memory cgroup's limit less its working set, else
    MemAvailable: poolloader.shm.backends.memfd) holds at the last epoch's USS per
    process. `POOLLOADER_AUTO_CPUS` overrides the CPU count.
The first epoch runs min(num_workers, CPUs) processes. With persistent_workers=True
the processes live across epochs, so the count is chosen once, at the first epoch.

Each move is recorded (`LoaderStats.auto_moves`, the runner's summary prints them).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

AUTO = "auto"
CPUS_ENV = "POOLLOADER_AUTO_CPUS"
RAISE_AT = 0.10
LOWER_AT = 0.02
FILL = 0.75
MEMORY_SHARE = 0.5  # of the memory available, as tf.data's AUTOTUNE RAM budget
MIN_STEADY_BATCHES = 4  # an epoch shorter than that says nothing: no move


def cpu_budget() -> int:
    """The CPUs this process may use: `POOLLOADER_AUTO_CPUS` when set, else its
    affinity mask, lowered to the cgroup's CPU quota (v2 cpu.max, v1
    cpu.cfs_quota_us / cpu.cfs_period_us), rounded up; at least 1."""
    text = os.environ.get(CPUS_ENV, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{CPUS_ENV}={text!r}: the CPUs node_workers='auto' may use "
                             f"must be a positive int (unset: the affinity mask and the "
                             f"cgroup's CPU quota)")
        return value
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_cpu_quota() -> float | None:
    """CPUs the cgroup's quota allows (quota / period), or None where none is set."""
    for path in ("/sys/fs/cgroup/cpu.max",):
        try:
            with open(path) as f:
                quota, _, period = f.read().strip().partition(" ")
        except OSError:
            continue
        if quota != "max" and period:
            try:
                return int(quota) / int(period)
            except ValueError:
                return None
        return None
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
        try:
            with open(os.path.join(root, "cpu.cfs_quota_us")) as f:
                quota_us = int(f.read())
            with open(os.path.join(root, "cpu.cfs_period_us")) as f:
                period_us = int(f.read())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def memory_budget() -> int:
    """Bytes the worker processes may take: MEMORY_SHARE of what is available."""
    from poolloader.shm.backends.memfd import memory_available
    return int(memory_available()[0] * MEMORY_SHARE)


@dataclass(frozen=True)
class Move:
    """One change of the process count, and what the epoch before it measured."""
    epoch: int          # the epoch that runs with `to` processes (1: the first)
    batch: int          # batches the loader had delivered then
    frm: int
    to: int
    waited: float       # share of the last epoch's steady time next() waited
    busy: float         # the last epoch's worker busy seconds over its steady seconds
    why: str

    def __str__(self) -> str:
        if not self.frm:
            return f"auto: {_processes(self.to)} from the first epoch ({self.why})"
        return (f"auto: {self.frm} → {_processes(self.to)} at batch {self.batch} (epoch "
                f"{self.epoch}), main waited {self.waited:.0%}, workers busy "
                f"{self.busy:.2f} processes' worth: {self.why}")


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


class AutoWorkers:
    """The process count of one loader's node_workers="auto" (see the module docstring).
    `processes(stats)` is called as each iterator is built, by the main process only."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.current = 0  # 0: no epoch ran yet
        self.epochs = 0
        self._mark: tuple | None = None  # the counters as the current epoch began
        self._per_process = 0  # USS per process the last epoch's workers had (bytes)

    def budget(self) -> tuple[int, str]:
        """(the most processes allowed now, what bounds it)."""
        limit, why = self.num_workers, f"num_workers={self.num_workers}"
        cpus = cpu_budget()
        if cpus < limit:
            limit, why = cpus, f"{cpus} CPUs"
        if self._per_process:
            fits = max(1, memory_budget() // self._per_process)
            if fits < limit:
                limit, why = fits, (f"memory: half of what is available holds {fits} "
                                    f"processes of {self._per_process / 2**20:.0f} MiB")
        return limit, why

    def workers_stopped(self, memory) -> None:
        """The memory report (poolloader.main.memory) read as an epoch's workers stopped."""
        if memory is not None and memory.workers:
            self._per_process = max(1, memory.workers_uss // len(memory.workers))

    def processes(self, stats) -> int:
        """The count for the epoch that starts now, decided from the one before."""
        self.epochs += 1
        limit, bound = self.budget()
        if not self.current:
            self.current = min(self.num_workers, limit)
            stats.auto_moves.append(Move(1, stats.batches, 0, self.current, 0.0, 0.0,
                                         f"min(num_workers, the budget: {bound})"))
        else:
            self.current = self._decide(stats, limit, bound)
        self._mark = (stats.iter_s, stats.steady_wait_s, stats.worker_busy_s,
                      stats.steady_batches)
        return self.current

    def _decide(self, stats, limit: int, bound: str) -> int:
        now = self.current
        if self._mark is None:
            return min(now, limit)
        iter_s, wait_s, busy_s, batches = (stats.iter_s - self._mark[0],
                                           stats.steady_wait_s - self._mark[1],
                                           stats.worker_busy_s - self._mark[2],
                                           stats.steady_batches - self._mark[3])
        if batches < MIN_STEADY_BATCHES or iter_s <= 0:
            return min(now, limit)
        waited, busy = wait_s / iter_s, busy_s / iter_s
        to, why = now, ""
        if now > limit:
            to, why = limit, f"over the budget ({bound})"
        elif waited >= RAISE_AT and now < limit:
            to, why = now + 1, f"main waited {RAISE_AT:.0%} or more"
        elif waited <= LOWER_AT and now > 1 and busy <= FILL * (now - 1):
            to, why = now - 1, (f"main waited {LOWER_AT:.0%} or less and "
                                f"{_processes(now - 1)} would be at most {FILL:.0%} busy")
        if to != now:
            stats.auto_moves.append(Move(self.epochs, stats.batches, now, to, waited, busy, why))
        return to
