"""Worker processes: start, watch, wait for, stop — the teardown ladder in one place.

Main keeps no pipe per fork or spawn worker (invariant 2), and one per forkserver
worker, the pipe its exit status arrives through: a worker is started by
poolloader.worker.popen, the one adapter over CPython's multiprocessing internals,
which closes the parent's other descriptors and keeps `join(timeout)`, `is_alive()`
and `exitcode` working.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import signal
import threading
import time
import weakref

from poolloader.errors import StallWarning, WorkerDied, warn
from poolloader.worker import zygote

# How long shutdown waits for workers to leave by themselves before terminating them.
JOIN_TIMEOUT = 1.0
# How long main sleeps between liveness checks while waiting for a reply (seconds).
MAIN_TICK = 0.1

_live: weakref.WeakSet = weakref.WeakSet()
# Reentrant: the collector may run inside `track` (the WeakSet's weakref is an
# allocation) and finalise a dead iterator there, whose teardown calls `untrack`.
_live_lock = threading.RLock()


@atexit.register
def _stop_all() -> None:
    # Runs before multiprocessing's own exit handler (registered earlier, runs
    # later), so names are unlinked before daemon workers are terminated.
    with _live_lock:
        owners = list(_live)
    for owner in owners:
        owner.shutdown_at_exit()


def track(owner) -> None:
    """`owner.shutdown_at_exit()` runs at interpreter exit unless it was shut down before."""
    with _live_lock:
        _live.add(owner)


def untrack(owner) -> None:
    with _live_lock:
        _live.discard(owner)


def join_all(processes, timeout: float) -> None:
    """Wait up to `timeout` s in all for the processes to exit (waitpid polling)."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def unique(processes) -> list:
    """Each process once, in order: with node_workers, one process stands for several
    logical workers."""
    return list(dict.fromkeys(processes))


def stop(processes) -> None:
    """The ladder, after the caller closed the request rings (which ends every
    worker): join with a deadline → terminate → kill, each bounded; each process once."""
    processes = unique(processes)
    try:
        join_all(processes, JOIN_TIMEOUT)
    finally:
        for step in ("terminate", "kill"):
            alive = [p for p in processes if p.is_alive()]
            if not alive:
                break
            for p in alive:
                getattr(p, step)()
            join_all(alive, 1.0)


def describe_exit(code) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def check_alive(processes, owed=()) -> None:
    """Raise WorkerDied for the first worker that has exited. Its message starts with
    DataLoader's own sentence for that death (code that matches it keeps working).

    `processes[i]` is logical worker i's process; with node_workers one process hosts
    several, and the message names the first of `owed` (logical workers with a
    request in flight, oldest first) that it hosts, else the first it hosts."""
    checked: set[int] = set()
    for first, w in enumerate(processes):
        if id(w) in checked:
            continue
        checked.add(id(w))
        if not w.is_alive():
            code = w.exitcode
            hosted = [k for k, p in enumerate(processes) if p is w]
            i = next((k for k in owed if k in hosted), first)
            death = getattr(w, "death", None)  # a node pool's process (poolloader.main.node)
            if death is not None:
                raise WorkerDied(death(i))
            zygote_pid = zygote.lost(w)
            if zygote_pid is not None:
                raise WorkerDied(
                    f"PoolLoader worker {i} (pid {w.pid}) was stopped: the start-up process "
                    f"that forked it (zygote, pid {zygote_pid}) exited, so nothing could "
                    "report its exit. The next iter() starts a new one; PoolLoader("
                    "zygote=False) or POOLLOADER_ZYGOTE=0 starts every worker as a fresh "
                    "interpreter instead.")
            where = ""
            if len(hosted) > 1:
                where = (f", the process hosting workers {', '.join(map(str, hosted))} "
                         "(node_workers)")
            if code is not None and code < 0:
                head = f"DataLoader worker (pid {w.pid}) is killed by signal: {_strsignal(-code)}. "
            else:
                head = f"DataLoader worker (pid {w.pid}) exited unexpectedly. "
            raise WorkerDied(
                f"{head}PoolLoader worker {i} (pid {w.pid}{where}) exited unexpectedly with "
                f"{describe_exit(code)}. If it was killed for memory (signal 9), lower "
                "num_workers or batch_size; run with num_workers=0 to see the error in "
                "the main process.")


def _strsignal(signum: int) -> str:
    try:
        return signal.strsignal(signum) or f"signal {signum}"
    except ValueError:
        return f"signal {signum}"


class Replies:
    """Main's side of the done rings: which worker returned which slot.

    `wait()` pops the next returned slot into `returned` (a deque of (slot, worker),
    the ledger's), polling the rings round-robin from the
    one after the last that answered (so no worker starves); with none returned it
    sleeps on the doorbell, checks worker liveness every MAIN_TICK and calls
    `on_tick()`, bounded by DataLoader's `timeout` (0: no limit). The time spent
    waiting is added to `stats.main_wait_s`.

    A stall is shown, not only timed out: the timeout's RuntimeError carries
    `stall_report()` (poolloader.main.stall: which worker owes which batch, since when, its
    stack) after DataLoader's first line; a wait that lasts `stall_warning` seconds
    (None: never) warns once with the same report and goes on waiting."""

    def __init__(self, control, workers, timeout: float, stats, on_tick,
                 stall_warning: float | None = None, stall_report=None,
                 returned=None, owed=None) -> None:
        """`owed()`: the logical workers with a request in flight, oldest first (the
        one a dead process owed is named: check_alive)."""
        self._rings = control.done_rings
        self._owed = owed
        self.returned = collections.deque() if returned is None else returned
        self._doorbell = control.doorbell
        self._workers, self._stats, self._on_tick = workers, stats, on_tick
        self._timeout, self._stall_warning, self._stall_report = timeout, stall_warning, stall_report
        self._start = 0  # where the next poll of the done rings begins (round robin)

    def waiting(self) -> int:
        """Replies returned and not yet taken by main (popped or not)."""
        return sum(len(r) for r in self._rings) + len(self.returned)

    def _poll(self) -> bool:
        rings, returned = self._rings, self.returned
        n = len(rings)
        for k in range(n):
            w = (self._start + k) % n
            had = len(returned)
            # one C-level call pops at most one slot and appends (slot, w): no signal
            # handler can run between the pop and the record, so no reply is lost
            returned.extend(zip(itertools.islice(iter(rings[w].try_pop, None), 1),
                                itertools.repeat(w)))
            if len(returned) > had:
                self._start = (w + 1) % n
                return True
        return False

    def wait(self) -> tuple[int, int]:
        """Pop the next reply into `returned` (at once if one is there already) and
        return its (slot, worker), which stays in `returned` for the caller to take off.
        Raises WorkerDied, ControlCorrupt (from a ring), or RuntimeError once `timeout`
        passes, DataLoader's message."""
        if self.returned:
            return self.returned[0]
        got = self._poll()
        if not got:
            self._doorbell.drain()  # the tokens of replies earlier polls took
            got = self._poll()
        if got:
            return self.returned[0]
        t0 = time.perf_counter()
        began = time.monotonic()
        deadline = began + self._timeout if self._timeout > 0 else None
        warn_at = began + self._stall_warning if self._stall_warning is not None else None
        try:
            while not got:
                wait = MAIN_TICK
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds"
                                           + self._report())
                if not self._doorbell.wait(wait):
                    check_alive(self._workers, self._owed() if self._owed else ())
                    self._on_tick()
                    if warn_at is not None and time.monotonic() >= warn_at:
                        warn_at = None  # once per stall: the next wait that stalls warns again
                        self._warn_stall(time.monotonic() - began)
                got = self._poll()
        finally:
            self._stats.main_wait_s += time.perf_counter() - t0
        return self.returned[0]

    def _report(self) -> str:
        """The stall report, on the lines after a first line that is the caller's."""
        if self._stall_report is None:
            return ""
        try:
            return "\nPoolLoader: " + self._stall_report()
        except Exception as e:  # a report must never hide the stall it reports
            return f"\nPoolLoader: no stall report ({type(e).__name__}: {e})"

    def _warn_stall(self, waited: float) -> None:
        warn(StallWarning(
            f"PoolLoader: next() has waited {waited:.1f} s for a batch and goes on waiting "
            f"(timeout={self._timeout}; this warning: stall_warning={self._stall_warning}, "
            "None turns it off)" + self._report()), StallWarning)

    def close(self) -> None:
        self._rings = []
        self._doorbell = None
        self._stall_report = None
        self._owed = None
