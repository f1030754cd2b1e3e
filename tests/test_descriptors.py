"""What main keeps open, and what a child of os.fork() inherits from it: a forkserver
worker costs main one descriptor, its exit-status pipe (poolloader.worker.popen), and the at-fork registry
(poolloader.shm.fork) never lets a child of a fork from another thread keep a pool
descriptor, with real processes and real threads."""
import gc
import os
import signal
import time

import diagnose_datasets as dd
import proc
import pytest
from helpers import wait_until

from poolloader import PoolLoader, WorkerDied


def _gone(pids, timeout=15.0) -> bool:
    return wait_until(lambda: not any(proc.pid_running(p) for p in pids), timeout)


# -- item 8: forkserver workers and main's descriptors ----------------------------------

def _main_fds_with_forkserver_workers(n: int, backend: str) -> tuple[int, list[str]]:
    """(count, targets) of main's descriptors with `n` live forkserver workers
    (persistent, after an epoch, once every worker mapped every segment)."""
    loader = PoolLoader(dd.BlockOnSample({}, n=12), batch_size=2, num_workers=n,
                        multiprocessing_context="forkserver", persistent_workers=True,
                        shm_backend=backend, slot_bytes=1 << 16)
    it = iter(loader)
    assert [int(b[0]) for b in it] == list(range(0, 12, 2))
    pool = it._pool
    # a memfd segment's descriptor is kept until every worker mapped it (tick: 0.25 s)
    assert wait_until(lambda mapped=pool.unlink_mapped: mapped() == 0, 20)
    pids = it.worker_pids
    assert all(proc.pid_running(p) for p in pids)
    assert all(w.is_alive() and w.exitcode is None for w in it._workers)
    seen = proc.fd_count(), sorted(t for t in proc.fd_targets() if not t.startswith("/dev/shm/"))
    del it, loader, pool
    gc.collect()
    assert _gone(pids), "workers left after the loader was dropped"
    return seen


@pytest.mark.parametrize("backend", ["posix", "memfd"])
def test_forkserver_main_keeps_one_descriptor_per_worker_its_exit_status(backend):
    """multiprocessing keeps two descriptors in main per forkserver child: the pipe the
    forkserver reports its exit status through and a dup of the start pipe.
    poolloader.worker.popen closes the dup; the status pipe stays, since it alone
    carries a forkserver child's exit code (4 more workers: exactly 4 more pipes)."""
    two = _main_fds_with_forkserver_workers(2, backend)
    six = _main_fds_with_forkserver_workers(6, backend)
    def pipes(seen):
        return sum(t.startswith("pipe:") for t in seen[1])

    assert six[0] == two[0] + 4 and pipes(six) == pipes(two) + 4, (
        f"main holds {two[0]} descriptors with 2 forkserver workers and {six[0]} "
        f"with 6 ({pipes(two)} and {pipes(six)} pipes): {six[1]}")


def test_forkserver_worker_killed_is_named_and_stuck_workers_are_stopped():
    """A forkserver worker's death is seen (WorkerDied naming it and its signal, which
    only the status pipe main keeps can tell), and a worker that ignores the closed rings (asleep in
    __getitem__) is stopped by the shutdown ladder (terminate, through its pidfd)."""
    loader = PoolLoader(dd.SleepDataset(8, 60.0), batch_size=2, num_workers=2,
                        multiprocessing_context="forkserver", slot_bytes=1 << 16)
    it = iter(loader)
    try:
        pids = it.worker_pids
        workers = list(it._workers)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            next(it)
        assert time.monotonic() - killed < 10
        message = str(info.value)
        assert f"worker 1 (pid {pids[1]})" in message and "SIGKILL" in message, message
        # worker 0, asleep for 60 s, is stopped by the ladder once the rings are closed
        assert _gone(pids, 15), [proc.pid_running(p) for p in pids]
        assert all(not w.is_alive() and w.exitcode is not None for w in workers)
    finally:
        del it


# -- item 7: the at-fork registry is atomic with a descriptor's creation and release ----

LABEL = "forkreg"  # memfd segments made here: /memfd:poolloader-forkreg


def _posix_name(i: int) -> str:
    return f"/pltest-{os.getpid()}-{LABEL}-{i}"


def _pool_fds_in_child() -> list[str]:
    """Fork, and return the targets of what the child holds open that a pool descriptor
    made here names (a memfd labelled LABEL, a POSIX segment named by _posix_name)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            found = []
            for entry in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{entry}")
                except OSError:
                    continue
                if (target.startswith(f"/memfd:poolloader-{LABEL}")
                        or f"pltest-{os.getppid()}-{LABEL}" in target):
                    found.append(f"{entry}->{target}")
            os.write(w, "\n".join(found).encode() + b"\n")
        finally:
            os._exit(0)
    os.close(w)
    try:
        chunks = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.001)
    return [line for line in b"".join(chunks).decode().splitlines() if line]


def _make_and_release(backend: str, i: int) -> None:
    """One pool descriptor made and released through poolloader's own code."""
    from poolloader.shm import backend as shm_backend
    from poolloader.shm import fork
    from poolloader.shm.backends import memfd, posix
    if backend == "memfd":
        mapping, fd, _inode = memfd.create(1 << 16, "a test segment", LABEL)
        shm_backend.retire(mapping)
        fork.release(fd)
    else:  # a slot segment's transient descriptor
        name = _posix_name(i)
        try:
            shm_backend.retire(posix.create_segment(name, 1 << 16, "a test segment"))
        finally:
            posix.unlink_quietly(name)


def _fork_while(window_fn, patched: str, monkeypatch, hold_s: float) -> list[str]:
    """Run `window_fn()` in a thread; when it calls os.`patched` (the point between a
    descriptor's creation and its record, or between forgetting it and closing it),
    it waits up to `hold_s` while this thread forks. Returns what the child kept."""
    import threading
    real = getattr(os, patched)
    creator = []
    reached, forked = threading.Event(), threading.Event()

    def paused(*args, **kw):
        if threading.get_ident() in creator and not reached.is_set():
            reached.set()
            forked.wait(hold_s)  # with the registry's lock held (fixed), the fork waits
        return real(*args, **kw)

    monkeypatch.setattr(os, patched, paused)
    errors = []

    def run():
        creator.append(threading.get_ident())
        try:
            window_fn()
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert reached.wait(30), f"os.{patched} was never called in the window"
        kept = _pool_fds_in_child()
    finally:
        forked.set()
        thread.join(30)
        monkeypatch.setattr(os, patched, real)
    assert not thread.is_alive() and not errors, errors
    return kept


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_a_fork_after_a_descriptor_is_created_and_before_it_is_recorded(backend, monkeypatch):
    """A fork from another thread while a segment is being made (its descriptor exists,
    its size is being set): the child must not keep that descriptor."""
    patched = "ftruncate" if backend == "memfd" else "posix_fallocate"
    kept = _fork_while(lambda: _make_and_release(backend, 0), patched, monkeypatch, 2.0)
    assert kept == [], f"the child of a fork during the creation kept {kept}"


def test_a_fork_inside_a_release_keeps_nothing(monkeypatch):
    """A fork from another thread between the registry forgetting a descriptor and its
    close: the child must not keep it."""
    from poolloader.shm import backend as shm_backend
    from poolloader.shm import fork
    from poolloader.shm.backends import memfd
    mapping, fd, _inode = memfd.create(1 << 16, "a test segment", LABEL)
    shm_backend.retire(mapping)
    kept = _fork_while(lambda: fork.release(fd), "close", monkeypatch, 1.0)
    assert kept == [], f"the child of a fork during the release kept {kept}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_forks_from_a_thread_while_descriptors_come_and_go_keep_none(backend):
    """300 forks from one thread while another makes and releases pool descriptors,
    the interpreter switching threads every microsecond: no child keeps one."""
    import sys
    import threading
    stop = threading.Event()
    made = [0]
    errors = []

    def churn():
        try:
            while not stop.is_set():
                _make_and_release(backend, made[0])
                made[0] += 1
        except BaseException as e:
            errors.append(e)

    kept = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    churner = threading.Thread(target=churn)
    churner.start()
    try:
        for _ in range(300):
            kept += _pool_fds_in_child()
    finally:
        stop.set()
        churner.join(60)
        sys.setswitchinterval(old)
    assert not churner.is_alive() and not errors, errors
    assert made[0] > 0
    assert kept == [], f"{len(kept)} descriptors kept by children ({made[0]} made): {kept[:5]}"
