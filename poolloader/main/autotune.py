"""PoolLoader(node_workers="auto"): how many processes host the num_workers logical
workers, chosen again before each epoch from what the epoch before measured, and
within an epoch every WINDOW_S seconds of steady delivery.

Why the batches cannot change: the num_workers logical workers fix them (each its
seed, RNG states, dataset copy and iterator; poolloader.worker.loop), and which process
hosts a logical worker changes none of that (`node_workers=P`). So the count may move
between epochs, and within one through the exact resume, with every batch still
DataLoader(num_workers)'s.

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
  * never outside 1 .. the budget: num_workers and the CPUs this process may use
    (sched_getaffinity, the smallest CPU quota of its cgroups; `POOLLOADER_AUTO_CPUS`
    overrides the count); and no process more where the last epoch's USS per process
    is over half the memory available (the memory cgroup's limit less its working set,
    else MemAvailable: poolloader.shm.backends.memfd). Memory never takes a process
    away: a process's USS is mostly its logical workers', which move with them.
The first epoch runs min(num_workers, CPUs) processes (under node_pool, below,
min(num_workers × local ranks, CPUs)).

Under node_pool the node's processes serve every local rank: the count is bounded by
num_workers × local ranks (and the CPUs), the rank that hosts the node decides before
each of its epochs from its own counters (its busy seconds counted once per local
rank, as each makes as many batches), and NodeHost.resize replaces the processes: the
old ones serve the iterators still attached to them (another rank finishing its epoch)
and exit after; each other rank takes the new ones as its next iterator attaches
(`follow` records them). There the count moves between epochs only (an iterator of
every rank would have to restart at once within one); a persistent iterator restarts
onto the new processes as its next epoch begins (PoolLoaderIter._follow_node).

Within an epoch the same rule reads each window of at least WINDOW_S seconds and
MIN_STEADY_BATCHES batches of steady delivery (`review`), and a move restarts the
iterator in place at a batch boundary, from its own resume state (PoolLoaderIter.
_move_processes: the requests in flight are drawn and fetched again by the new
processes, as after load_state_dict()), so every batch stays DataLoader's. The window
(and the first batch after a move counts as start-up, not steady time) keeps the
count from moving faster than the processes can show what a move did; after a move
it lasts at least RESTART_TIMES what the restart took, so restarts cost at most about
a fifth of the time however slow they are. A decision between epochs reads the whole
epoch since its last move, not only what came after the last window. With
persistent_workers=True this is how the count moves at all after the first epoch.
Where an iterator cannot restart in place exactly (PoolLoaderIter._moves_in_epoch:
stateful=False, an IterableDataset or a datapipe, device=/pin_memory staging,
share_batches), the count moves only between epochs.

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
WINDOW_S = 2.0  # within an epoch: the steady seconds a review reads (and the least between moves)
RESTART_TIMES = 4  # ... and at least this many times what the last move's restart took


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
    """The smallest CPU quota (quota / period) of the cgroup levels above this process
    (poolloader.shm.backends.memfd.cgroup_levels: without a cgroup namespace, as under
    Slurm or a systemd slice, the limit is in a sub-directory). None where none is set."""
    from poolloader.shm.backends.memfd import cgroup_levels
    found = [q for q in (_quota(d, v) for d, v in cgroup_levels("cpu")) if q is not None]
    return min(found) if found else None


def _quota(directory: str, version: str) -> float | None:
    """One cgroup directory's CPU quota in CPUs, or None (no limit, or not readable)."""
    try:
        if version == "v2":
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, _, period = f.read().strip().partition(" ")
            return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def memory_budget() -> int:
    """Bytes the worker processes may take: MEMORY_SHARE of what is available."""
    from poolloader.shm.backends.memfd import memory_available
    return int(memory_available()[0] * MEMORY_SHARE)


@dataclass(frozen=True)
class Move:
    """One choice of the process count (a change, or one more process refused for
    memory), and what the epoch (or window) before it measured."""
    epoch: int          # the epoch that runs with `to` processes (1: the first)
    batch: int          # batches the loader had delivered then
    frm: int
    to: int
    waited: float       # share of the last epoch's (window's) steady time next() waited
    busy: float         # its worker busy seconds over its steady seconds
    why: str
    within: bool = False  # made inside the epoch, from a review window
    host: int | None = None  # node_pool: the local rank that chose it, on the others

    @property
    def _where(self) -> str:
        return f"{'in' if self.within else 'before'} epoch {self.epoch}"

    def __str__(self) -> str:
        if not self.frm:
            return f"auto: {_processes(self.to)} from the first epoch ({self.why})"
        if self.host is not None:
            return (f"auto: {self.frm} → {_processes(self.to)} at batch {self.batch} "
                    f"({self._where}): {self.why}")
        if self.frm == self.to:  # a move the rule wanted and the memory budget refused
            return (f"auto: kept {_processes(self.to)} at batch {self.batch} "
                    f"({self._where}), main waited {self.waited:.0%}: {self.why}")
        return (f"auto: {self.frm} → {_processes(self.to)} at batch {self.batch} "
                f"({self._where}), main waited {self.waited:.0%}, workers busy "
                f"{self.busy:.2f} processes' worth: {self.why}")


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


class AutoWorkers:
    """The process count of one loader's node_workers="auto" (see the module docstring).
    `processes(stats)` is called as each iterator is built, by the main process only."""

    def __init__(self, num_workers: int, ranks: int = 1) -> None:
        """`ranks`: the local ranks whose logical workers the processes host (node_pool:
        the host rank decides for the node from its own counters, its busy seconds
        counted `ranks` times, each rank making as many batches)."""
        self.num_workers = num_workers
        self.ranks = ranks
        self.current = 0  # 0: no epoch ran yet
        self.epochs = 0
        self._mark: tuple | None = None  # the counters as the current window began
        self._since: tuple | None = None  # as the current epoch began, or its last move
        self._moved = False  # the current window began with a move within the epoch
        self._per_process = 0  # USS per process the last epoch's workers had (bytes)

    def budget(self) -> tuple[int, str]:
        """(the most processes the CPUs allow, what bounds it)."""
        limit, why = self.num_workers * self.ranks, f"num_workers={self.num_workers}"
        if self.ranks > 1:
            why += f" × {self.ranks} local ranks"
        cpus = cpu_budget()
        if cpus < limit:
            limit, why = cpus, f"{cpus} CPUs"
        return limit, why

    def _memory_refuses(self) -> str | None:
        """Why one process more does not fit in memory, or None. Its cost is taken as the
        last epoch's USS per process, an overestimate: most of a process's USS is its
        logical workers' (dataset copies, states), which move with them. For that same
        reason memory never takes a process away: fewer processes free little."""
        if not self._per_process:
            return None
        budget = memory_budget()
        if self._per_process <= budget:
            return None
        return (f"one process more ({self._per_process / 2**20:.0f} MiB, the last "
                f"epoch's USS per process) is over half the memory available "
                f"({budget / 2**20:.0f} MiB)")

    def workers_stopped(self, memory) -> None:
        """The memory report (poolloader.main.memory) read as an epoch's workers stopped."""
        if memory is not None and memory.workers:
            self._per_process = max(1, memory.workers_uss // len(memory.workers))

    def processes(self, stats) -> int:
        """The count for the iterator built now (each epoch's, without persistent
        workers), decided from what the counters gained since the last one was built."""
        self.epochs += 1
        limit, bound = self.budget()
        if not self.current:
            self.current = limit
            stats.auto_moves.append(Move(1, stats.batches, 0, self.current, 0.0, 0.0,
                                         f"min(num_workers"
                                         f"{' × local ranks' if self.ranks > 1 else ''}, "
                                         f"the budget: {bound})"))
        else:
            # from the whole epoch (since its last move): a review's window may have
            # ended a few batches before the epoch did
            self.current = self._decide(stats, limit, bound, self._since)
        self.mark(stats)
        self._since = self._mark
        self._moved = False  # an epoch's start-up is not a move's (a zygote's start, say)
        return self.current

    def follow(self, stats, processes: int, host_rank: int, attached: bool = False) -> int:
        """node_pool on a rank that does not host: the count its host chose (`processes`,
        read as this rank's iterator is built; `attached`: the one its attach found
        instead, the host having moved in between), recorded as this rank's moves too."""
        if not attached:
            self.epochs += 1
        if processes != self.current:
            stats.auto_moves.append(Move(self.epochs, stats.batches, self.current, processes,
                                         0.0, 0.0, f"chosen by local rank {host_rank}, which "
                                         "hosts the node pool", host=host_rank))
            self.current = processes
        return processes

    def kept(self, stats, processes: int, why: str) -> int:
        """node_pool on the host: the move just decided did not happen (`why`); the
        `processes` running go on, and the next decision starts from them."""
        last = stats.auto_moves[-1] if stats.auto_moves else None
        stats.auto_moves.append(Move(self.epochs, stats.batches, processes, processes,
                                     last.waited if last else 0.0, last.busy if last else 0.0,
                                     why))
        self.current = processes
        from poolloader.errors import warn
        warn(f"PoolLoader(node_workers='auto'): {why}; {_processes(processes)} go on")
        return processes

    def review_at(self, stats) -> float:
        """The steady time (`stats.iter_s`) at which the next review within the epoch is
        due: the iterator compares one float per batch."""
        if self._mark is None:
            return stats.iter_s + WINDOW_S
        return self._mark[0] + self._window(stats)

    def _window(self, stats) -> float:
        """The steady seconds the current window needs: WINDOW_S, or, in a window a move
        began, RESTART_TIMES the start-up time since (the restart: stopping the workers,
        starting the new ones, their first batch) where that is longer, so that restarts
        take at most about a fifth of the time whatever they cost (spawn without a
        zygote: seconds)."""
        if not self._moved or self._mark is None:
            return WINDOW_S
        return max(WINDOW_S, RESTART_TIMES * (stats.startup_s - self._mark[4]))

    def review(self, stats, epochs_in: int = 0) -> int | None:
        """Within an epoch, once `review_at` has passed: the count to move to, or None
        (no move; too few batches yet). Decided from the window since the last review
        or move, which starts the next window. `epochs_in`: epochs a persistent
        iterator has run since it was built (its moves are recorded in the right one)."""
        if self._mark is not None and (stats.steady_batches - self._mark[3] < MIN_STEADY_BATCHES
                                       or stats.iter_s - self._mark[0] < self._window(stats)):
            return None
        limit, bound = self.budget()
        before = self.current
        self.current = self._decide(stats, limit, bound, self._mark, self.epochs + epochs_in,
                                    within=True)
        self.mark(stats)
        self._moved = self.current != before
        if not self._moved:
            return None
        self._since = self._mark  # what the epoch measured before the move is the old count's
        return self.current

    def mark(self, stats) -> None:
        """The counters a window starts from (`_mark`): as an iterator is built, after a
        review. `_since`: those the next epoch's choice reads from (the iterator's
        build, or the last move within the epoch)."""
        self._mark = (stats.iter_s, stats.steady_wait_s, stats.worker_busy_s,
                      stats.steady_batches, stats.startup_s)

    def _decide(self, stats, limit: int, bound: str, mark: tuple | None,
                epoch: int | None = None, within: bool = False) -> int:
        """The count after the steady delivery since `mark` (the counters then)."""
        now = self.current
        epoch = self.epochs if epoch is None else epoch
        waited = busy = 0.0
        to, why = now, ""
        measured = False
        if mark is not None:
            iter_s, wait_s, busy_s = (stats.iter_s - mark[0], stats.steady_wait_s - mark[1],
                                      stats.worker_busy_s - mark[2])
            batches = stats.steady_batches - mark[3]
            # a counter that went back says nothing (the workers' counters of an iterator
            # left open across epochs join the sums only when it closes:
            # LoaderStats.detach_pool)
            measured = (batches >= MIN_STEADY_BATCHES and iter_s > 0 and wait_s >= 0
                        and busy_s >= 0)
            if measured:
                waited, busy = min(1.0, wait_s / iter_s), busy_s * self.ranks / iter_s
        if now > limit:
            to, why = limit, f"over the budget ({bound})"
        elif not measured:
            pass  # too short an epoch to say anything: no move
        elif waited >= RAISE_AT and now < limit:
            refused = self._memory_refuses()
            if refused is None:
                to, why = now + 1, f"main waited {RAISE_AT:.0%} or more"
            elif not stats.auto_moves or stats.auto_moves[-1].why != refused:  # said once
                stats.auto_moves.append(Move(epoch, stats.batches, now, now, waited,
                                             busy, refused, within))
        elif waited <= LOWER_AT and now > 1 and busy <= FILL * (now - 1):
            to, why = now - 1, (f"main waited {LOWER_AT:.0%} or less and "
                                f"{_processes(now - 1)} would be at most {FILL:.0%} busy")
        if to != now:
            stats.auto_moves.append(Move(epoch, stats.batches, now, to, waited, busy, why,
                                         within))
        return to
