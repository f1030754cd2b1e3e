"""The one adapter over CPython's multiprocessing internals, for both ends of a worker.

Why it reaches in: multiprocessing keeps two descriptors in the parent for each child,
serving only `Process.join(timeout)`, the exit code and the child's `parent_process()`
(fork and spawn: the sentinel pipe and the write end of the pipe the child watches;
forkserver: the pipe the forkserver writes the exit status into and a dup of the start
pipe's write end); 32 workers would need 64 descriptors in main. There is no public way
to start a Process without them, so:

* main (`start_without_pipes`): right after `start()`, the parent's descriptors are
  closed and the process object's wait becomes waitpid polling, so `join(timeout)`,
  `is_alive()` and `exitcode` still work for any code that calls them. A forkserver
  child is the forkserver's, not main's: main cannot waitpid it, and its exit status
  (the signal of an OOM kill) reaches main only through the status pipe, so that one
  descriptor per forkserver worker stays (invariant 2's one exception: DataLoader's
  forkserver workers keep it too, plus the start pipe's dup, which is closed here).
* worker (`parent_process_through`): multiprocessing's `parent_process()` answers
  `is_alive()`/`join()` from the pipe main just closed, so it would read main as dead;
  it is replaced by one that asks the pool's owner probe, as DataLoader's answers,
  and whose `sentinel` (that pipe's end, ready at once) is a descriptor that reads as
  ready only once main is gone (`_main_sentinel`).

Nothing else in poolloader touches `Process._popen`, `Popen.sentinel`, `finalizer` or
`multiprocessing.process._parent_process`.
"""
from __future__ import annotations

import multiprocessing.process
import os
import threading
import time
from pickle import PicklingError

from poolloader.errors import warn

# Start methods whose Popen.poll() uses waitpid, not the sentinel pipe.
_WAITPID_POPENS = ("multiprocessing.popen_fork", "multiprocessing.popen_spawn_posix")
_FORKSERVER_POPEN = "multiprocessing.popen_forkserver"


def start_without_pipes(ctx, target, args, zygote=None):
    """Start one daemon process of `ctx` and drop its parent-side pipe ends. A pickling
    error (spawn/forkserver) gets the warning DataLoader gives, word for word, before it
    is re-raised. With `zygote` (poolloader.worker.zygote, spawn/forkserver) the process
    is forked by it, and keeps a forkserver child's status pipe."""
    process = ctx.Process(target=target, args=args, daemon=True)
    try:
        if zygote is not None:
            from poolloader.worker.zygote import start
            start(process, zygote)
        else:
            process.start()
    except (TypeError, AttributeError, PicklingError):
        warn(  # at the user's line (the caller of iter(loader))
            "Got pickle error when attempting to start a worker Process. "
            "This might be because the worker Process arguments are not picklable. "
            "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
            "to 'forkserver', which requires the worker Process arguments to be picklable. "
            "You can also try multiprocessing.set_start_method('fork').")
        raise
    popen = process._popen
    if type(popen).__module__ in _WAITPID_POPENS and getattr(popen, "finalizer", None):
        popen.finalizer()
        popen.sentinel = None
        process._sentinel = None
        popen.wait = lambda timeout=None: _poll_wait(popen, timeout)
    elif (any(c.__module__ == _FORKSERVER_POPEN for c in type(popen).__mro__)
          and getattr(popen, "finalizer", None)):
        _drop_start_pipe_dup(popen)
    return process


def _drop_start_pipe_dup(popen) -> None:
    """Close the dup of a forkserver child's start pipe that its Popen keeps (it only
    keeps the child's own `parent_process().sentinel` from reading as ready, which
    `parent_process_through` answers instead); the status pipe stays (module
    docstring). The finalizer then closes that one alone."""
    from multiprocessing import util

    fds: tuple = getattr(popen.finalizer, "_args", ())
    if len(fds) != 2 or fds[1] != popen.sentinel:
        return  # another Python's layout: keep both, as multiprocessing does
    start_dup, status = fds
    popen.finalizer.cancel()
    os.close(start_dup)
    popen.finalizer = util.Finalize(popen, os.close, (status,))


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


# How often the fallback sentinel's thread asks whether main lives (seconds).
_WATCH_TICK = 0.25


def _main_sentinel(pid: int, owner) -> int:
    """A descriptor that reads as ready once main (`pid`, whose life `owner.is_alive()`
    tells) is gone, as multiprocessing's sentinel pipe under DataLoader: a pidfd of main,
    checked against the owner probe after it was opened (so a pid reused after main died
    is never watched); where pidfd_open is not allowed (Linux < 5.3, a seccomp filter),
    a pipe whose write end a daemon thread closes when the probe says main is gone."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        if owner.is_alive():
            return fd  # main lived after the open: the pidfd is main's
        os.close(fd)
    read, write = os.pipe()
    if not owner.is_alive():
        os.close(write)  # main is gone: ready at once
        return read

    def watch() -> None:
        while owner.is_alive():
            time.sleep(_WATCH_TICK)
        os.close(write)

    threading.Thread(target=watch, name="poolloader-parent-sentinel", daemon=True).start()
    return read


class _ParentThroughOwner(multiprocessing.process._ParentProcess):  # type: ignore[name-defined]
    """A worker's parent_process(): same name and pid as multiprocessing's; is_alive()
    and join() ask `owner` whether main lives, and `sentinel` is not ready while it does
    (made on first use: multiprocessing's reads as ready, since main closed the other
    end of its pipe)."""

    def __init__(self, name, pid, sentinel, owner) -> None:
        super().__init__(name, pid, sentinel)
        self._owner = owner
        self._watched: int | None = None
        self._watch_lock = threading.Lock()

    @property
    def sentinel(self) -> int:
        with self._watch_lock:
            if self._watched is None:
                self._watched = _main_sentinel(self.pid, self._owner)
            return self._watched

    def is_alive(self) -> bool:
        return self._owner.is_alive()

    def join(self, timeout=None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._owner.is_alive():
            pause = 0.01
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
                if pause <= 0:
                    return
            time.sleep(pause)


def parent_process_through(owner) -> None:
    """In a worker: `multiprocessing.parent_process()` answers `is_alive()` and `join()`
    through `owner` (whose `is_alive()` says whether main lives: the pool's owner
    probe). Under forkserver too (main keeps those pipes there, and the probe gives the
    same answer)."""
    parent = multiprocessing.process._parent_process  # type: ignore[attr-defined]
    if parent is None or isinstance(parent, _ParentThroughOwner):
        return
    multiprocessing.process._parent_process = _ParentThroughOwner(  # type: ignore[attr-defined]
        parent.name, parent.pid, parent._sentinel, owner)
