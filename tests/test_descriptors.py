"""What main keeps open, and what a child of os.fork() inherits from it: forkserver
workers cost main no descriptor (poolloader.worker.popen), and the at-fork registry
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
def test_forkserver_main_keeps_no_descriptor_per_worker(backend):
    """Main's open descriptors with 2 and with 6 live forkserver workers are the same:
    multiprocessing keeps two per forkserver child (the exit-code pipe and a dup of the
    start pipe), which poolloader.worker.popen closes."""
    two = _main_fds_with_forkserver_workers(2, backend)
    six = _main_fds_with_forkserver_workers(6, backend)
    assert six[0] == two[0], (
        f"main holds {two[0]} descriptors with 2 forkserver workers and {six[0]} "
        f"with 6: {sorted(set(six[1]) - set(two[1]))}")


def test_forkserver_worker_killed_is_named_and_stuck_workers_are_stopped():
    """Without its pipes, a forkserver worker's death is still seen (WorkerDied naming it
    within the liveness tick), and a worker that ignores the closed rings (asleep in
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
        assert f"worker 1 (pid {pids[1]})" in message, message
        # worker 0, asleep for 60 s, is stopped by the ladder once the rings are closed
        assert _gone(pids, 15), [proc.pid_running(p) for p in pids]
        assert all(not w.is_alive() and w.exitcode is not None for w in workers)
    finally:
        del it
