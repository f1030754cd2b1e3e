"""Counters a user reads to tell whether the loader is the bottleneck, and which side
(public as poolloader.stats.LoaderStats).

Main-side counters are plain attributes updated on the iterator's own path (an
add per batch). Worker-side counters live in the pool's control block, each
worker writing only its own row; reading them sums a few integers.
"""
from __future__ import annotations

import time

from poolloader.main.memory import MemoryReport, report


class LoaderStats:
    """Live counters of one PoolLoader, across its iterators and epochs.

    batches          batches delivered to the consumer
    main_wait_s      seconds next() spent blocked waiting for a worker
                     (high: the workers are the bottleneck)
    worker_busy_s    seconds workers spent producing batches (fetch, collate, write), summed
    worker_idle_s    seconds workers spent waiting for a request, summed (high: the
                     consumer, or a pool with too few free slots, is the bottleneck)
    worker_batches   batches workers produced (includes prefetched ones)
    slot_growths     slots replaced by a bigger segment (a batch did not fit)
    pool_growths     slots added to the pool: slots= was below what num_workers ×
                     prefetch_factor requests in flight need, the consumer held every
                     slot, or every other slot was cooling (see cooling_growths)
    detaches         held batches detached from the pool: the consumer kept every
                     slot's batch, so the oldest one's segment left the pool with it
    pages_returned   times a FREE slot's pages were given back to the system because
                     the pool had been deeper than its requests and held batches
                     needed for a while (ledger.IDLE_TAKES; never on CUDA: see
                     SlotLedger._return_idle)
    requests_moved   requests moved, before their worker started on them, from a slot
                     whose pages no batch had written to a FREE one that a batch had:
                     the clean slot stays uncharged (issue 45; PoolLoaderIter._move_newest)
    cooling_growths  slots added because every free slot was still cooling: waiting
                     for CUDA copies that may read it (pin_memory=True / device=)
    cooling_waits    times next() had to wait for a cooling slot (the pool was at
                     max_slots); cooling_wait_s: seconds spent so. High: raise max_slots
    startup_s        seconds from each epoch's start (workers starting, with
                     non-persistent workers) to its first batch, summed
    iter_s           seconds from each epoch's first batch to its last, summed: the
                     steady state that advice() reads; steady_batches: the batches
                     delivered in it, next_s: seconds next() took for them (waiting
                     included), steady_wait_s: seconds of main_wait_s among those
    num_workers      workers of the latest pool
    slot_count, slot_bytes, pool_bytes: the current pool (0 when none exists)
    detached_bytes   shared memory of batches detached from the pool that the consumer
                     still holds (theirs, like a DataLoader batch; not the pool's own):
                     freed as those batches are dropped
    peak_slot_count, peak_pool_bytes: the largest pool any iterator had (pools only
                     grow while they live), still there after the pool is gone
    processes        worker processes of the latest pool (num_workers, or fewer with
                     node_workers=P or "auto"; under node_pool the node's count, which
                     serves every local rank)
    auto_moves       node_workers="auto": each choice of the process count, with what
                     the epoch before it measured (poolloader.main.autotune.Move;
                     str() of one reads "auto: 2 → 3 processes at batch 120 ...")

    memory()         the workers' and main's memory, read from /proc now (a
                     poolloader.main.memory.MemoryReport: per live worker its id, pid,
                     uss, pss, rss and shared bytes, main's, and the workers' sums;
                     the pool's resident bytes against its reserved ones;
                     no workers when no iterator is live; with node_workers= one entry per
                     process, under the first logical worker it hosts). Costs one /proc read per
                     process, so it is a call, never done per batch
    last_memory      the memory() an iterator read just before it stopped its workers
                     (its last moment with them alive: the end of a non-persistent
                     epoch, or the iterator's shutdown), when `memory_at_shutdown` is
                     True (False by default; `python -m poolloader` sets it for its
                     summary); None until then

    Every counter accumulates over the loader's lifetime (a non-persistent loader
    makes a new pool each epoch; the pool's worker counters are added up when it
    closes). `learned_slot_bytes` is the largest slot size any pool needed: the
    next pool starts there instead of growing again. `advice()` reads them for you.
    """

    def __init__(self) -> None:
        self.batches = 0
        self.main_wait_s = 0.0
        self.slot_growths = 0
        self.pool_growths = 0
        self.detaches = 0
        self.pages_returned = 0
        self.requests_moved = 0
        self.cooling_growths = 0
        self.cooling_waits = 0
        self.cooling_wait_s = 0.0
        self.learned_slot_bytes = 0
        self.startup_s = 0.0
        self.iter_s = 0.0
        self.next_s = 0.0
        self.steady_wait_s = 0.0
        self.steady_batches = 0
        self.num_workers = 0
        self.processes = 0
        self.auto_moves: list = []
        self._closed_workers = [0, 0, 0]  # worker columns of pools already closed
        self._closed_peak = (0, 0)  # (slots, bytes) of the largest pool already closed
        self.memory_at_shutdown = False
        self.last_memory: MemoryReport | None = None
        self._pool = None
        self._ledger = None
        self._workers: list = []  # the live iterator's worker processes (attach_pool)

    def __getstate__(self) -> dict:
        # pickle / deepcopy (of a loader mid-epoch, as DataLoader allows): the copy
        # holds the counters as they read now, without the live pool (shared memory
        # cannot be copied; the copy's loader makes its own pool when iterated)
        state = dict(self.__dict__)
        pool = self._live_pool()
        if pool is not None:
            state["_closed_workers"] = [self._worker_column(c) for c in range(3)]
            state["_closed_peak"] = (self.peak_slot_count, self.peak_pool_bytes)
        state["_pool"] = state["_ledger"] = None
        state["_workers"] = []
        return state

    # -- what the iterator (poolloader.main.iterator) calls ------------------------------
    def count_delivery(self, entered: float, waited: float, last: float | None,
                       epoch_started: float) -> float:
        """Main's per-batch accounting, once a batch is delivered (a few adds): `entered`
        when next() was called, `waited` main_wait_s then, `last` when the epoch's
        previous batch was delivered (None: this is its first). Returns now."""
        now = time.perf_counter()
        if last is None:
            self.startup_s += now - epoch_started
        else:
            self.iter_s += now - last
            self.next_s += now - entered
            self.steady_wait_s += self.main_wait_s - waited
            self.steady_batches += 1
        return now

    def advice(self) -> str:
        """Which side is the bottleneck and what to change, each statement with the
        measured shares behind it (poolloader.main.advice); `diagnose()` is the same as data."""
        from poolloader.main.advice import advise
        return advise(self).text

    def diagnose(self):
        """advice() as a poolloader.main.advice.Advice: verdict, statements and the shares."""
        from poolloader.main.advice import advise
        return advise(self)

    def attach_pool(self, pool, ledger=None, workers=None) -> None:
        """Called by the iterator once `pool` serves this loader (its live figures are read
        from it, and `ledger`'s detached bytes; `workers`: its worker processes, by worker
        id, whose memory memory() reads)."""
        self._pool = pool
        self._ledger = ledger
        self._workers = [] if workers is None else workers

    def workers_stopping(self, pool) -> None:
        """Called by the iterator of `pool` just before it stops its workers: keeps their
        memory as last_memory when memory_at_shutdown is set (once per iterator, never
        per batch)."""
        if self.memory_at_shutdown and self._pool is pool and self._live_pool() is not None:
            try:
                self.last_memory = self.memory()
            except Exception:  # a figure for a summary must not fail a teardown
                pass  # (at interpreter exit, say); last_memory keeps the previous report

    def memory(self) -> MemoryReport:
        """The live workers' memory and main's, read from /proc now (see the class
        docstring), and the live pool's resident bytes against its reserved bytes
        (`pool_resident`, `pool_reserved`: mincore over every slot). A worker that has
        exited, or exits while this reads, is left out."""
        live = []
        pool = self._live_pool()
        figures = (0, 0)
        if pool is not None:
            resident = getattr(pool, "resident_bytes", None)
            figures = (resident() if resident is not None else 0, pool.total_bytes)
            seen = set()  # with node_workers= one process hosts several logical workers
            for worker_id, process in enumerate(self._workers):
                # exitcode polls without waiting; a live child's pid is not reused until
                # this process reaps it, so the pid read next is still that worker's
                if process.pid is not None and process.pid not in seen and process.exitcode is None:
                    seen.add(process.pid)
                    live.append((worker_id, process.pid))
        return report(live, pool=figures)

    def detach_pool(self, pool) -> None:
        """Called by the iterator before it closes `pool`: its worker counters and peaks
        are kept."""
        for column in range(3):
            self._closed_workers[column] += pool.worker_counter(column)
        self.learned_slot_bytes = max(self.learned_slot_bytes, pool.target_bytes)
        self._closed_peak = (max(self._closed_peak[0], pool.num_slots),
                             max(self._closed_peak[1], pool.total_bytes))
        if self._pool is pool:
            self._pool = None
            self._ledger = None
            self._workers = []

    def _live_pool(self):
        pool = self._pool
        return pool if pool is not None and pool.is_open else None

    def _worker_column(self, column: int) -> int:
        pool = self._live_pool()
        live = 0 if pool is None else pool.worker_counter(column)
        return self._closed_workers[column] + live

    @property
    def worker_batches(self) -> int:
        return self._worker_column(0)

    @property
    def worker_busy_s(self) -> float:
        return self._worker_column(1) / 1e9

    @property
    def worker_idle_s(self) -> float:
        return self._worker_column(2) / 1e9

    def _pool_figure(self, name: str) -> int:
        """One size figure of the live pool (SlotPool's property `name`); 0 once closed."""
        pool = self._live_pool()
        return 0 if pool is None else getattr(pool, name)

    @property
    def slot_count(self) -> int:
        return self._pool_figure("num_slots")

    @property
    def slot_bytes(self) -> int:
        return self._pool_figure("largest_slot_bytes")

    @property
    def pool_bytes(self) -> int:
        return self._pool_figure("total_bytes")

    @property
    def detached_bytes(self) -> int:
        ledger = self._ledger
        return 0 if ledger is None else ledger.detached_bytes()

    @property
    def peak_slot_count(self) -> int:
        return max(self._closed_peak[0], self.slot_count)

    @property
    def peak_pool_bytes(self) -> int:
        return max(self._closed_peak[1], self.pool_bytes)

    def as_dict(self) -> dict:
        return {
            "batches": self.batches, "main_wait_s": round(self.main_wait_s, 6),
            "worker_batches": self.worker_batches,
            "worker_busy_s": round(self.worker_busy_s, 6),
            "worker_idle_s": round(self.worker_idle_s, 6),
            "slot_growths": self.slot_growths, "pool_growths": self.pool_growths,
            "detaches": self.detaches, "pages_returned": self.pages_returned,
            "requests_moved": self.requests_moved,
            "cooling_growths": self.cooling_growths, "cooling_waits": self.cooling_waits,
            "cooling_wait_s": round(self.cooling_wait_s, 6),
            "startup_s": round(self.startup_s, 6), "iter_s": round(self.iter_s, 6),
            "next_s": round(self.next_s, 6), "steady_wait_s": round(self.steady_wait_s, 6),
            "steady_batches": self.steady_batches, "num_workers": self.num_workers,
            "processes": self.processes, "auto_moves": [str(m) for m in self.auto_moves],
            "slot_count": self.slot_count, "slot_bytes": self.slot_bytes,
            "pool_bytes": self.pool_bytes, "detached_bytes": self.detached_bytes,
            "peak_slot_count": self.peak_slot_count, "peak_pool_bytes": self.peak_pool_bytes,
        }

    def __repr__(self) -> str:
        return "LoaderStats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"
