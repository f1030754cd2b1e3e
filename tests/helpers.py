"""Shared-memory and process helpers for the tests (no pytest import: spawned
children import this module, so it stays cheap to import).

Ownership of a test segment: the test that calls `make_shared` owns the name and
must `unlink_shared` it once every process that needs it has mapped it (a forked
child inherits the mapping, so the name can go before the fork; a spawned child
maps it by name, so the name goes after the child says it is attached). The
conftest fixture fails any test that leaves the name behind.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import posix_ipc
import proc
from proc import pid_running  # noqa: F401 - the tests import it from here

from poolloader.shm._shm import Mapping

LINE = 64  # every shared object must start on a 64-byte boundary


def align(nbytes, to=LINE):
    """`nbytes` rounded up to a multiple of `to`."""
    return (nbytes + to - 1) // to * to


def layout(*sizes):
    """Offsets for objects of `sizes` bytes packed into one segment, each on its own
    64-byte line; returns (offsets, total_nbytes)."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end = align(end + size)
    return offsets, end


def make_shared(nbytes, name):
    """Create the POSIX segment `name` of `nbytes` (O_CREX: fails if it exists), map it.

    Returns (Mapping, name). The descriptor is closed before returning; the name
    stays until `unlink_shared(name)`.
    """
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
    try:
        mapping = Mapping(shm.fd, nbytes)
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()
    return mapping, name


def attach_shared(name, nbytes):
    """Map an existing segment by name (what a spawned child does); no fd is kept."""
    shm = posix_ipc.SharedMemory(name)
    try:
        return Mapping(shm.fd, nbytes)
    finally:
        shm.close_fd()


def unlink_shared(name):
    """Remove `name` from /dev/shm; True if it was there. Safe to call twice."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


@contextlib.contextmanager
def running(process, join_timeout=10.0):
    """Start `process`; on exit join it with a timeout, then kill it by pid.

    Never hangs and never leaves the child behind, whatever the test body raised.
    Whether the child exited on its own is for the test to assert (exitcode).
    """
    process.start()
    try:
        yield process
    finally:
        process.join(join_timeout)
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join(5.0)


def leftovers(pids, marker, settle_s=5.0):
    """What processes `pids` (and their children) left behind, after up to `settle_s`:
    (shm names carrying one of `pids`, pids of live processes whose command line holds
    `marker`, e.g. a test's tmp folder, which forked workers inherit)."""
    deadline = time.monotonic() + settle_s
    while True:
        names = [n for n in os.listdir("/dev/shm")
                 if any(f"-{pid}-" in n or f"_{pid}_" in n for pid in pids)]
        procs = [pid for pid in proc.pids() if pid != os.getpid() and marker in proc.command(pid)]
        if not (names or procs) or time.monotonic() > deadline:
            return names, procs
        time.sleep(0.1)


def wait_until(predicate, timeout: float) -> bool:
    """Poll `predicate` every 20 ms; False if it is still false after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_in_futex(pid: int, tid: int | None = None, timeout: float = 10.0,
                  within: tuple[int, int] | None = None) -> bool:
    """Until thread `tid` of process `pid` (its main thread by default) sleeps in the
    kernel in a futex wait: a blocked ring or doorbell call (a process-shared semaphore).

    `within` (start, end): the futex word must lie in that address range (a ring's
    memory), which tells a thread of this process blocked in the ring from one waiting
    for the GIL. Without it (another process, single-threaded: nothing else waits
    there) the thread must be seen waiting on two looks 20 ms apart. False if that
    did not happen within `timeout` s."""
    task = f"/proc/{pid}/task/{tid if tid is not None else pid}"
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        try:
            with open(f"{task}/wchan") as f:
                waiting = f.read().startswith("futex")
            if waiting and within is not None:
                with open(f"{task}/syscall") as f:
                    fields = f.read().split()  # "nr arg1 ... sp pc", or "running"
                waiting = len(fields) > 1 and within[0] <= int(fields[1], 16) < within[1]
        except OSError:
            return False
        seen = seen + 1 if waiting else 0
        if seen >= (1 if within is not None else 2):
            return True
        time.sleep(0.02)
    return False


def communicate_within(proc: subprocess.Popen, timeout: float, what: str) -> tuple:
    """(stdout, stderr) of `proc` once it exits; past `timeout` s it is killed and an
    AssertionError carries `what` and the tail of what it printed."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"{what} ran longer than {timeout} s:\n{(out or '')[-2000:]}\n"
                             f"{(err or '')[-3000:]}") from None
