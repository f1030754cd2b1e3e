"""Bodies of the child processes in test_isolation.py (`python _isolation_children.py
<body> <args...>`).

Kept apart so that whatever could crash (a ring with corrupt fields), hang, or must
run as PID 1 of a new PID namespace runs in its own interpreter under the test's
timeout. Each body reports on stdout: `READY ...` lines where the test must act, and
one `RESULT <json>` line at the end (`each` runs one body for several modes: a RESULT
per mode).
"""
import json
import os
import signal
import subprocess
import sys
import time

from proc import pid_running as running

HERE = os.path.dirname(os.path.abspath(__file__))
SHM = "/dev/shm"


def _result(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def names_with(prefix):
    return sorted(n for n in os.listdir(SHM) if ("/" + n).startswith(prefix + "-"))


def _reap():
    """Collect every exited child (PID 1 of a namespace inherits every orphan)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _wait_until(predicate, timeout, reap=False):
    deadline = time.monotonic() + timeout
    while True:
        if reap:
            _reap()
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _read_ready(proc, timeout):
    """The child's READY line, split; fails the body if it does not come in time."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            sys.exit(f"no READY from pid {proc.pid} within {timeout} s")
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        sys.exit(f"pid {proc.pid} said {line!r} instead of READY (exit {proc.poll()})")
    return line[1:]


def _set_next_pid(pid):
    """Make `pid` the next one this PID namespace hands out (needs CAP_SYS_ADMIN in it)."""
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))


# ---------------------------------------------------------------------------
# PID 1 of a new PID namespace

def ns_init(first_pid, body, *args):
    """Run `body` (another function here) as a child whose pid is `first_pid` (0: any),
    reaping orphans meanwhile, and exit with its status. As PID 1, this process's
    exit kills everything left in the namespace."""
    if int(first_pid):
        _set_next_pid(int(first_pid))
    child = subprocess.Popen([sys.executable, __file__, body, *args])
    deadline = time.monotonic() + 150
    while child.poll() is None and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    if child.poll() is None:
        child.kill()
        child.wait()
        sys.exit(f"{body} still running after 150 s")
    sys.exit(child.returncode)


def ns_init_own_shm(first_pid, body, *args):
    """ns_init with a /dev/shm of this namespace's own: a tmpfs mounted over it in the
    mount namespace that unshare's --mount-proc made (private: nothing outside sees
    it, and it goes with the namespace). A body that leaves a dead job's names on
    purpose and then checks who removes them needs it: every POSIX pool made anywhere
    on the machine sweeps dead owners' names, and under pytest-xdist another test of
    the same run makes such pools at any moment."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=1777", "tmpfs", SHM],
                   check=True, timeout=30)
    ns_init(first_pid, body, *args)


# ---------------------------------------------------------------------------
# loaders

def loader_epochs(tag, epochs, method, workers):
    """Non-persistent epochs (each one a new pool, and so a sweep) over TaggedSamples;
    every value checked. Prints `EPOCH <k> <prefix>` per epoch, then RESULT."""
    import robustness_datasets as rds

    from poolloader import PoolLoader

    tag, n = int(tag), 24
    loader = PoolLoader(rds.TaggedSamples(tag, n), batch_size=4, num_workers=int(workers),
                        multiprocessing_context=method, slot_bytes=1 << 16, timeout=60)
    prefixes = []
    for epoch in range(int(epochs)):
        it = iter(loader)
        prefixes.append(it._pool.prefix)
        seen = []
        for batch in it:
            index = batch["index"]
            assert (batch["image"] == (tag * 1000 + index).double().view(-1, 1, 1, 1)).all()
            seen += index.tolist()
        assert seen == list(range(n)), f"epoch {epoch}: {seen}"
        print("EPOCH", epoch, prefixes[-1], flush=True)
        del it
    _result(pid=os.getpid(), prefixes=prefixes)


def main_until_killed(method, hold):
    """A training process that runs until killed: a persistent loader with 2 workers.
    With `hold`, it also forks a child that outlives it (inheriting whatever a fork
    inherits: a forkserver's keep-alive pipe, any descriptor without a fork hook).
    Prints `READY <prefix> <pid> <holder pid or 0> <worker pids...>`."""
    import robustness_datasets as rds

    from poolloader import PoolLoader

    signal.alarm(120)  # never outlive a lost test
    loader = PoolLoader(rds.TaggedSamples(5, 100_000), batch_size=2, num_workers=2,
                        multiprocessing_context=method, slot_bytes=1 << 16,
                        persistent_workers=True)
    it = iter(loader)
    next(it)
    holder = 0
    if int(hold):
        holder = os.fork()
        if holder == 0:
            time.sleep(60)
            os._exit(0)
    print("READY", it._pool.prefix, os.getpid(), holder, *[w.pid for w in it._workers], flush=True)
    time.sleep(120)


def pid_reuse(method, what):
    """Run under ns_init in a new PID namespace. Start main_until_killed (with a holder
    child), SIGKILL main (what="main": its workers must notice and remove the names;
    what="all": main, workers and holder at once, and a new pool's sweep must remove
    them), then hand main's pid to a new process before anything is checked, so a
    check by pid finds that pid alive."""
    from poolloader.shm.backends.posix import sweep_stale

    main = subprocess.Popen([sys.executable, __file__, "main_until_killed", method, "1"],
                            stdout=subprocess.PIPE, text=True)
    prefix, main_pid, holder, *workers = _read_ready(main, 90)
    main_pid, holder, workers = int(main_pid), int(holder), [int(w) for w in workers]
    victims = [main_pid] + (workers + [holder] if what == "all" else [])
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    main.wait(10)
    _wait_until(lambda: not any(running(p) for p in victims), 10, reap=True)
    _set_next_pid(main_pid)
    squatter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left_at_reuse = names_with(prefix)
    swept = []
    if what == "all":
        swept = sweep_stale()
    gone = _wait_until(lambda: not names_with(prefix) and not any(running(w) for w in workers),
                       8.0, reap=True)
    _result(recycled=squatter.pid == main_pid, main_pid=main_pid, squatter=squatter.pid,
            left_at_reuse=left_at_reuse, swept=swept, gone=gone, names=names_with(prefix),
            workers_alive=[w for w in workers if running(w)])
    squatter.kill()
    if holder and running(holder):
        os.kill(holder, signal.SIGKILL)
    _reap()


def dead_and_live_jobs():
    """Job A (main_until_killed, fork) is SIGKILLed with its workers, so nobody removes
    its names; job B lives on. Records what is left after the kill, after a new pool
    (whose start-up sweeps) and after a second sweep, then SIGKILLs B's main alone and
    records whether B's workers remove its names and leave."""
    from poolloader.shm.backends.posix import sweep_stale
    from poolloader.shm.pool import SlotPool

    def start():
        job = subprocess.Popen([sys.executable, __file__, "main_until_killed", "fork", "0"],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
        prefix, main_pid, _, *workers = _read_ready(job, 90)
        return job, prefix, int(main_pid), [int(w) for w in workers]

    def kill_group(job):
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait(10)

    a, a_prefix, _, a_workers = start()
    b, b_prefix, b_main, b_workers = start()
    try:
        kill_group(a)
        _wait_until(lambda: not any(running(w) for w in a_workers), 10, reap=True)
        a_left = names_with(a_prefix)
        b_before = names_with(b_prefix)
        pool = SlotPool(num_workers=1, slots=1, max_slots=2, slot_bytes=1 << 16)
        try:
            a_after_pool, b_after_pool = names_with(a_prefix), names_with(b_prefix)
            removed = sweep_stale()  # a second sweep: B and this pool are alive
            wrongly_removed = [n for n in removed if ("/" + n).startswith((b_prefix, pool.prefix))]
            pool_names = names_with(pool.prefix)
        finally:
            pool.close()
        b_alive = b.poll() is None
        os.kill(b_main, signal.SIGKILL)
        b_gone = _wait_until(lambda: not names_with(b_prefix), 5.0, reap=True)
        b_workers_gone = _wait_until(lambda: not any(running(w) for w in b_workers), 5.0, reap=True)
    finally:
        kill_group(a)
        kill_group(b)
    _result(a_left=a_left, b_before=b_before, a_after_pool=a_after_pool,
            b_after_pool=b_after_pool, wrongly_removed=wrongly_removed, pool_names=pool_names,
            b_alive=b_alive, b_gone=b_gone, b_left=names_with(b_prefix),
            b_workers_gone=b_workers_gone)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def forkserver_dies():
    """Main keeps running while its forkserver is SIGKILLed: the workers (the
    forkserver's children) must keep the pool's names and keep running."""
    import multiprocessing.forkserver as forkserver

    import robustness_datasets as rds

    from poolloader import PoolLoader
    from poolloader.worker import zygote

    signal.alarm(120)
    loader = PoolLoader(rds.TaggedSamples(6, 100_000), batch_size=2, num_workers=2,
                        multiprocessing_context="forkserver", slot_bytes=1 << 16,
                        persistent_workers=True)
    it = iter(loader)
    assert int(next(it)["index"][0]) == 0
    prefix, workers = it._pool.prefix, [w.pid for w in it._workers]
    # the process that forked them: the loader's zygote (poolloader.worker.zygote), or
    # multiprocessing's forkserver under PoolLoader(zygote=False)
    server = _ppid(workers[0])
    assert server in (forkserver._forkserver._forkserver_pid, *zygote.pids()), server
    os.kill(server, signal.SIGKILL)
    os.waitpid(server, 0)
    time.sleep(1.5)  # six idle ticks of every worker
    names_after = names_with(prefix)
    alive_after = [w for w in workers if running(w)]
    it._shutdown_workers()
    gone = _wait_until(lambda: not names_with(prefix) and not any(running(w) for w in workers), 5.0)
    _result(prefix=prefix, server=server, workers=workers, names_after=names_after,
            alive_after=alive_after, gone=gone)


# ---------------------------------------------------------------------------
# untrusted bytes

RING_FIELDS = {"capacity": 1, "head": 8, "tail": 16}  # u64 index of each field (csrc/ring.h)
CORRUPTIONS = {
    # mode: (field, how to change it)
    "capacity_zero": ("capacity", lambda v: 0),
    "capacity_huge": ("capacity", lambda v: 1 << 62),
    "tail_far_ahead": ("tail", lambda v: v + 1_000_003),
    "head_past_tail": ("head", lambda v: v + 1_000_003),
}


def _corrupt_ring(u64, offset, mode):
    field, change = CORRUPTIONS[mode]
    at = offset // 8 + RING_FIELDS[field]
    u64[at] = change(int(u64[at]))


def corrupt_ring(mode):
    """One ring, four values queued, one field overwritten: every operation must raise
    ControlCorrupt (or refuse to attach), never crash or touch memory past the ring."""
    import numpy as np

    from poolloader.errors import ControlCorrupt
    from poolloader.shm._ring import Ring
    from poolloader.shm._shm import Mapping

    fd = os.memfd_create("pltest-ring")
    nbytes = Ring.nbytes(5) + 4096  # a page after the ring that must stay untouched
    os.ftruncate(fd, nbytes)
    memory = Mapping(fd, nbytes)
    os.close(fd)
    outcomes = {}
    for op in ("push", "pop", "len", "attach"):
        ring = Ring(memory, 0, capacity=5, label="test ring")
        for value in range(4):
            ring.push(value, timeout=0)
        u64 = np.frombuffer(memory, np.uint64)
        _corrupt_ring(u64, 0, mode)
        after = bytes(memory)[Ring.nbytes(5):]
        try:
            if op == "push":
                got = ring.try_push(99)
            elif op == "pop":
                got = ring.try_pop()
            elif op == "len":
                got = len(ring)
            else:
                got = Ring(memory, 0, label="test ring").capacity
            outcomes[op] = f"returned {got!r}"
        except ControlCorrupt as e:
            outcomes[op] = f"ControlCorrupt: {e}"
            try:
                ring.try_pop()  # broken for good in this process
                outcomes[op] += " | then returned"
            except ControlCorrupt:
                outcomes[op] += " | then ControlCorrupt again"
        except ValueError as e:
            outcomes[op] = f"ValueError: {e}"
        assert bytes(memory)[Ring.nbytes(5):] == after, f"{op} wrote past the ring"
        del u64, ring
        memory_view = np.frombuffer(memory, np.uint8)
        memory_view[:] = 0
        del memory_view
    _result(mode=mode, outcomes=outcomes)


def _overwrite_control(prefix, mode):
    """The worker-like writer: maps the pool's control block by name, as a worker does,
    and overwrites one field of every ring (or pushes a value main never sent)."""
    import numpy as np

    from poolloader.shm.backends.posix import control_name, open_segment
    from poolloader.shm.control import Control, ControlLayout

    mapping = open_segment(control_name(prefix))
    num_workers, max_slots = Control.read_shape(mapping)
    layout = ControlLayout(num_workers, max_slots)
    if mode in ("slot_outside_pool", "ticket_gone_back"):
        from poolloader.shm._ring import Ring
        from poolloader.wire.slot_format import ring_value

        # -5: no slot; slot 0 under ticket 1, which main gave out long before
        value = -5 if mode == "slot_outside_pool" else ring_value(0, 1)
        Ring(mapping, layout.request_ring_offset(0)).push(value, timeout=1.0)
        return
    u64 = np.frombuffer(mapping, np.uint64)
    for w in range(num_workers):
        for offset in (layout.request_ring_offset(w), layout.done_ring_offset(w)):
            _corrupt_ring(u64, offset, mode)


def corrupt_live_loader(mode):
    """A loader with two fork workers delivers three batches; once the workers are idle
    (every request answered), a separate process overwrites the control block. Main
    then asks for more batches and must raise a clear error within its timeout."""
    import multiprocessing

    import robustness_datasets as rds

    from poolloader import PoolLoader

    signal.alarm(100)
    loader = PoolLoader(rds.TaggedSamples(7, 400), batch_size=2, num_workers=2,
                        multiprocessing_context="fork", slot_bytes=1 << 16, timeout=30)
    it = iter(loader)
    for _ in range(3):
        next(it)
    prefix, workers = it._pool.prefix, list(it._workers)
    # the workers answer the outstanding requests and wait for more
    if not _wait_until(lambda live=it: live.prefetched[0] == live.prefetched[1], 20.0):
        sys.exit(f"the workers did not answer their requests in 20 s: {it.prefetched}")
    writer = multiprocessing.get_context("fork").Process(target=_overwrite_control,
                                                         args=(prefix, mode))
    writer.start()
    writer.join(10)
    assert writer.exitcode == 0, f"writer exited with {writer.exitcode}"
    t0 = time.monotonic()
    outcome, delivered = None, 0
    while delivered < 100:
        try:
            next(it)
            delivered += 1
        except Exception as e:  # noqa: BLE001 - the exception is the outcome
            outcome = e
            break
    took = time.monotonic() - t0
    error = type(outcome).__name__ if outcome else None
    message = str(outcome) if outcome else ""
    exitcodes = {}
    del it, outcome  # the exception's traceback holds the iterator
    import gc

    gc.collect()  # the iterator is shut down; its workers exit
    for w in workers:  # their sentinel pipes are closed (poolloader.worker.popen): poll waitpid
        _wait_until(lambda w=w: not w.is_alive(), 5.0)
        exitcodes[w.pid] = w.exitcode
    _result(mode=mode, error=error, message=message, delivered=delivered, took=took,
            worker_exitcodes=exitcodes, names=names_with(prefix))


def each(body, *modes):
    """`body(mode)` for every mode in turn, in this one interpreter (one torch import
    for all): `MODE <mode>` before each, so a crash shows where; each prints its RESULT."""
    for mode in modes:
        print(f"MODE {mode}", flush=True)
        globals()[body](mode)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    globals()[sys.argv[1]](*sys.argv[2:])
