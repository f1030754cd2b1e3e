"""Worker processes: start, watch, stop — the teardown ladder in one place.

Main keeps no pipe per worker (invariant 2): multiprocessing keeps two pipe ends
in the parent for each fork or spawn child, serving only `Process.join(timeout)`
and the child's `parent_process()`; 32 workers would need 64 descriptors. They are
closed right after start, and the process object's wait is replaced by waitpid
polling, so `join(timeout)`, `is_alive()` and `exitcode` still work for any code
that calls them. Forkserver children keep theirs: their exit code arrives through it.
"""
from __future__ import annotations

import atexit
import signal
import threading
import time
import warnings
import weakref
from pickle import PicklingError

from poolloader.errors import WorkerDied

# How long shutdown waits for workers to leave by themselves before terminating them.
JOIN_TIMEOUT = 1.0

# Start methods whose Popen.poll() uses waitpid, not the sentinel pipe.
_WAITPID_POPENS = ("multiprocessing.popen_fork", "multiprocessing.popen_spawn_posix")

_live: weakref.WeakSet = weakref.WeakSet()
_live_lock = threading.Lock()


@atexit.register
def _stop_all() -> None:
    # Runs before multiprocessing's own exit handler (registered earlier, runs
    # later), so names are unlinked before daemon workers are terminated.
    with _live_lock:
        owners = list(_live)
    for owner in owners:
        owner._shutdown_at_exit()


def track(owner) -> None:
    """`owner._shutdown_at_exit()` runs at interpreter exit unless it was shut down before."""
    with _live_lock:
        _live.add(owner)


def untrack(owner) -> None:
    with _live_lock:
        _live.discard(owner)


def _poll_wait(popen, timeout=None):
    """Popen.wait without the sentinel pipe: waitpid polling, bounded by `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while True:
        code = popen.poll()
        if code is not None:
            return code
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            pause = min(pause, left)
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def start_worker(ctx, target, args):
    """Start one daemon worker process and drop its parent-side pipe ends."""
    process = ctx.Process(target=target, args=args, daemon=True)
    try:
        process.start()
    except (TypeError, AttributeError, PicklingError):
        # what DataLoader says, word for word, before it re-raises (spawn/forkserver)
        warnings.warn(
            "Got pickle error when attempting to start a worker Process. "
            "This might be because the worker Process arguments are not picklable. "
            "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
            "to 'forkserver', which requires the worker Process arguments to be picklable. "
            "You can also try multiprocessing.set_start_method('fork').",
            stacklevel=4)
        raise
    popen = process._popen
    if type(popen).__module__ in _WAITPID_POPENS and getattr(popen, "finalizer", None):
        popen.finalizer()
        popen.sentinel = None
        process._sentinel = None
        popen.wait = lambda timeout=None: _poll_wait(popen, timeout)
    return process


def join_all(processes, timeout: float) -> None:
    """Wait up to `timeout` s in all for the processes to exit (waitpid polling)."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def stop(processes) -> None:
    """The ladder, after the caller closed the request rings (which ends every
    worker): join with a deadline → terminate → kill, each bounded."""
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


def check_alive(processes) -> None:
    """Raise WorkerDied for the first worker that has exited."""
    for i, w in enumerate(processes):
        if not w.is_alive():
            raise WorkerDied(
                f"PoolLoader worker {i} (pid {w.pid}) exited unexpectedly with "
                f"{describe_exit(w.exitcode)}. If it was killed for memory (signal 9), lower "
                "num_workers or batch_size; run with num_workers=0 to see the error in "
                "the main process.")
