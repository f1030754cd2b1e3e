"""The one adapter over CPython's multiprocessing internals, for both ends of a worker.

Why it reaches in: multiprocessing keeps two descriptors in the parent for each child,
serving only `Process.join(timeout)`, the exit code and the child's `parent_process()`
(fork and spawn: the sentinel pipe and the write end of the pipe the child watches;
forkserver: the pipe the forkserver writes the exit code into and a dup of the start
pipe); 32 workers would need 64 descriptors in main, and invariant 2 says main keeps
no descriptor per worker. There is no public way to start a Process without them, so:

* main (`start_without_pipes`): right after `start()`, the parent's descriptors are
  closed and the process object's wait becomes polling, so `join(timeout)`,
  `is_alive()`, `exitcode`, `terminate()` and `kill()` still work for any code that
  calls them. Fork and spawn children are main's: waitpid. A forkserver child is the
  forkserver's, which reaps it: it is known by (pid, start time) from /proc/<pid>/stat,
  alive while that process is there and not a zombie, signalled through a pidfd opened
  after that identity is checked (never a reused pid); its exit code is read from
  /proc while it is a zombie and is otherwise unknown (`exit_unknown()`; `exitcode`
  then reads 255, multiprocessing's own value for a lost forkserver). Where
  /proc/<pid>/stat cannot be read, a forkserver child keeps its two descriptors.
* worker (`parent_process_through`): multiprocessing's `parent_process()` answers
  `is_alive()`/`join()` from the pipe main just closed, so it would read main as dead;
  it is replaced by one that asks the pool's owner probe, as DataLoader's answers.

Nothing else in poolloader touches `Process._popen`, `Popen.sentinel`, `finalizer` or
`multiprocessing.process._parent_process`.
"""
from __future__ import annotations

import multiprocessing.process
import os
import signal
import time
import warnings
from pickle import PicklingError

# Start methods whose Popen.poll() uses waitpid, not the sentinel pipe.
_WAITPID_POPENS = ("multiprocessing.popen_fork", "multiprocessing.popen_spawn_posix")
_FORKSERVER_POPEN = "multiprocessing.popen_forkserver"
# Process.exitcode of a forkserver child reaped before main saw its status (as
# multiprocessing's forkserver Popen reports a child whose exit code it lost).
EXIT_UNKNOWN = 255
_GONE = (b"Z", b"X", b"x")  # /proc/<pid>/stat states of an exited process


def start_without_pipes(ctx, target, args):
    """Start one daemon process of `ctx` and drop its parent-side pipe ends. A pickling
    error (spawn/forkserver) gets the warning DataLoader gives, word for word, before it
    is re-raised."""
    process = ctx.Process(target=target, args=args, daemon=True)
    try:
        process.start()
    except (TypeError, AttributeError, PicklingError):
        warnings.warn(
            "Got pickle error when attempting to start a worker Process. "
            "This might be because the worker Process arguments are not picklable. "
            "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
            "to 'forkserver', which requires the worker Process arguments to be picklable. "
            "You can also try multiprocessing.set_start_method('fork').",
            stacklevel=5)  # the caller of iter(loader)
        raise
    popen = process._popen
    if type(popen).__module__ in _WAITPID_POPENS and getattr(popen, "finalizer", None):
        popen.finalizer()
        popen.sentinel = None
        process._sentinel = None
        popen.wait = lambda timeout=None: _poll_wait(popen, timeout)
    elif type(popen).__module__ == _FORKSERVER_POPEN and getattr(popen, "finalizer", None):
        _drop_forkserver_pipes(process, popen)
    return process


def exit_unknown(process) -> bool:
    """Whether `process.exitcode` is EXIT_UNKNOWN because its status was lost (a
    forkserver child reaped by the forkserver before main looked), not a real 255."""
    return getattr(process._popen, "exit_unknown", False)


def _stat(pid: int) -> tuple[bytes, int, int | None] | None:
    """(state, start time in clock ticks since boot, waitpid status or None) of `pid`
    from /proc/<pid>/stat; None if there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # comm may hold spaces and ")"
    try:
        status = int(fields[49]) if len(fields) > 49 else None  # exit_code (Linux 3.5+)
        return fields[0], int(fields[19]), status
    except (IndexError, ValueError):
        return None


def _drop_forkserver_pipes(process, popen) -> None:
    """Close a forkserver child's two descriptors in main; it is known from then on by
    (pid, start time) (module docstring). Kept as it is if its identity cannot be read
    (no /proc, or it has already exited: then its exit code may be in the pipe)."""
    stat = _stat(popen.pid)
    if stat is None or stat[0] in _GONE:
        return
    born = stat[1]
    popen.finalizer()
    popen.sentinel = None
    process._sentinel = None
    popen.exit_unknown = False
    popen.poll = lambda flag=os.WNOHANG: _identity_poll(popen, born, flag)
    popen.wait = lambda timeout=None: _poll_wait(popen, timeout)
    popen._send_signal = lambda sig: _signal_identity(popen, born, sig)


def _identity_poll(popen, born: int, flag=os.WNOHANG):
    """Popen.poll of a forkserver child without its pipe: None while the process that
    has its pid and start time runs; blocking (flag 0) polls until it has exited."""
    pause = 0.001
    while popen.returncode is None:
        stat = _stat(popen.pid)
        if stat is None or stat[1] != born:  # reaped (its pid may be another's now)
            popen.returncode, popen.exit_unknown = EXIT_UNKNOWN, True
        elif stat[0] in _GONE:  # a zombie the forkserver has not reaped yet
            if stat[2] is None:
                popen.returncode, popen.exit_unknown = EXIT_UNKNOWN, True
            else:
                popen.returncode = os.waitstatus_to_exitcode(stat[2])
        elif flag == os.WNOHANG:
            return None
        else:
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    return popen.returncode


def _signal_identity(popen, born: int, sig: int) -> None:
    """Popen._send_signal of a forkserver child without its pipe: through a pidfd opened
    before its identity is checked, so the signal reaches that child or nothing."""
    if popen.returncode is not None:
        return
    try:
        pidfd = os.pidfd_open(popen.pid)
    except ProcessLookupError:
        _identity_poll(popen, born)
        return
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): the pid, checked just before
        if _identity_poll(popen, born) is None:
            try:
                os.kill(popen.pid, sig)
            except ProcessLookupError:
                pass
        return
    try:
        # the pidfd names what held the pid when it was opened; if that process is
        # still the one started (same start time), it was this child then too
        if _identity_poll(popen, born) is None:
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                pass
    finally:
        os.close(pidfd)


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


class _ParentThroughOwner(multiprocessing.process._ParentProcess):  # type: ignore[name-defined]
    """A worker's parent_process(): same name, pid and sentinel as multiprocessing's;
    is_alive() and join() ask `owner` whether main lives (its `sentinel` still reads
    as closed: nothing holds the other end)."""

    def __init__(self, name, pid, sentinel, owner) -> None:
        super().__init__(name, pid, sentinel)
        self._owner = owner

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
