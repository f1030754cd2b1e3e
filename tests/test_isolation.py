"""Shared memory safe between jobs (issue 13): whose names a sweep may remove, what a
worker can make main read, and how a worker knows that main has died.

Everything runs real processes over real /dev/shm. What must run in a new PID
namespace (`unshare --pid --fork --mount-proc`, root or CAP_SYS_ADMIN) is skipped
with the reason where that is not permitted; what could crash (a ring with corrupt
fields) or must outlive a SIGKILL runs in a child interpreter
(`_isolation_children.py`) under a timeout.

Names and their owner lock are the POSIX backend's, so every pool here, in this
process and in the children (which inherit the environment), is a POSIX one
(POOLLOADER_SHM_BACKEND=posix). The memfd backend names nothing: tests/test_container.py.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import proc
import pytest
import robustness_datasets as rds
from helpers import pid_running as running
from helpers import wait_until

from poolloader import ControlCorrupt, PoolLoader, SlotCorrupt
from poolloader.shm.backends.posix import slot_name, sweep_stale
from poolloader.shm.control import Control
from poolloader.shm.pool import SlotPool

HERE = os.path.dirname(os.path.abspath(__file__))
CHILDREN = os.path.join(HERE, "_isolation_children.py")
SHM = "/dev/shm"
# How a worker learns that main died: the owner lock on the control segment (one fcntl
# on its descriptor; poolloader.worker.loop._parent_alive), whatever the start method. A
# fork worker inherits that descriptor from main; a forkserver worker (whose parent is
# the forkserver, which may outlive main) gets it through its start-up arguments, as a
# spawn worker does: fork and forkserver cover both ways, spawn adds only its start-up.
START_METHODS = ["fork", "forkserver"]


@pytest.fixture(autouse=True)
def posix_backend(monkeypatch):
    monkeypatch.setenv("POOLLOADER_SHM_BACKEND", "posix")


def names_with(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if ("/" + n).startswith(prefix + "-"))


def run_child(*args, timeout: float, prefix=()) -> tuple[subprocess.CompletedProcess, dict]:
    """Run a body of _isolation_children.py; returns the process and its RESULT."""
    try:
        proc = subprocess.run([*prefix, sys.executable, CHILDREN, *map(str, args)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"child {args} still running after {timeout} s:\n{e.stdout}\n{e.stderr}")
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc, json.loads(results[-1]) if results else {}


def describe(proc) -> str:
    code = proc.returncode
    signame = f" ({signal.Signals(-code).name})" if code < 0 else ""
    return f"exit {code}{signame}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


@functools.cache
def _namespace_refusal() -> str | None:
    """Why a new PID namespace whose next pid we choose cannot be made here, or None."""
    try:
        probe = subprocess.run(
            [*UNSHARE, "sh", "-c", "echo 40 > /proc/sys/kernel/ns_last_pid && sh -c 'echo $$'"],
            capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "no unshare(1) on this machine (util-linux)"
    except subprocess.TimeoutExpired:
        return "unshare did not answer within 30 s"
    if probe.returncode != 0 or probe.stdout.strip() != "41":
        return ("cannot make a PID namespace and choose its pids here (needs root or "
                f"CAP_SYS_ADMIN): {probe.stderr.strip() or probe.stdout.strip()}")
    return None


def needs_pid_namespace():
    reason = _namespace_refusal()
    if reason:
        pytest.skip(reason)


@functools.cache
def _own_shm_refusal() -> str | None:
    """Why such a namespace cannot also mount a /dev/shm of its own (ns_init_own_shm)."""
    try:
        probe = subprocess.run([*UNSHARE, "mount", "-t", "tmpfs", "tmpfs", "/dev/shm"],
                               capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "unshare did not answer within 30 s"
    if probe.returncode != 0:
        return f"cannot mount a tmpfs on /dev/shm in a new mount namespace: {probe.stderr.strip()}"
    return None


def needs_pid_namespace_with_own_shm():
    needs_pid_namespace()
    reason = _own_shm_refusal()
    if reason:
        pytest.skip(reason)


# -- 1. whose names a sweep removes ------------------------------------------------------------

def a_pid_range_unused_here(span: int = 64) -> int:
    """The first of `span` pids that no process of this namespace has: a loader given
    it inside a new namespace looks dead to anything out here that judges by pid, and
    none of the pids the inner namespace hands out next is one of ours."""
    top = int(open("/proc/sys/kernel/pid_max").read())
    taken = set(proc.pids())
    for first in range(min(top - span, 30_000), 300, -span):
        if not taken & set(range(first, first + span)):
            return first
    pytest.skip(f"no {span} consecutive unused pids found")


def test_a_loader_in_its_own_pid_namespace_survives_loaders_outside_it(tmp_path):
    """Like another container sharing /dev/shm (docker --ipc=host): a loader runs three
    non-persistent spawn epochs inside a new PID namespace while this process keeps
    running spawn epochs of its own out here. Every new pool sweeps /dev/shm, on both
    sides, and each side's pids mean nothing in the other's namespace: the inner
    loader's pid is one no process out here has, and this process's pid does not exist
    in there. Before issue 13 each side's sweep unlinked the other's names and the
    other side's spawn workers died finding them gone. Now neither side may remove the
    other's names: every epoch on both sides completes."""
    needs_pid_namespace()
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    inner = subprocess.Popen(
        [*UNSHARE, sys.executable, CHILDREN, "ns_init", str(a_pid_range_unused_here()),
         "loader_epochs", "11", "3", "spawn", "1"], stdout=out, stderr=err)
    outer_epochs = 0
    try:
        loader = PoolLoader(rds.TaggedSamples(12, 16), batch_size=4, num_workers=1,
                            multiprocessing_context="spawn", slot_bytes=1 << 16, timeout=30)
        deadline = time.monotonic() + 150
        while inner.poll() is None and time.monotonic() < deadline:
            got = [i for batch in loader for i in batch["index"].tolist()]
            assert got == list(range(16)), f"outer epoch {outer_epochs}: {got}"
            outer_epochs += 1
        try:
            inner.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail("the loader in the PID namespace still running after 150 s")
    finally:
        if inner.poll() is None:
            inner.kill()  # --kill-child takes the namespace down with it
            inner.wait(10)
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    epochs = [line.split() for line in stdout.splitlines() if line.startswith("EPOCH")]
    print(f"inner: {len(epochs)} spawn epochs; outer: {outer_epochs} spawn epochs meanwhile")
    assert inner.returncode == 0, f"exit {inner.returncode}\n{stdout[-2000:]}\n{stderr[-5000:]}"
    assert [int(e[1]) for e in epochs] == [0, 1, 2]
    assert outer_epochs >= 2, "the outer loop did not overlap the inner epochs"
    for _, _, prefix in epochs:
        assert not names_with(prefix), prefix


def _start_main(method: str, hold: bool):
    """main_until_killed in its own session; returns (process, prefix, main, holder, workers)."""
    child = subprocess.Popen([sys.executable, CHILDREN, "main_until_killed", method, str(int(hold))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    line = []
    reader = threading.Thread(target=lambda: line.append(child.stdout.readline()), daemon=True)
    reader.start()
    reader.join(90)
    if not (line and line[0].startswith("READY")):
        child.kill()
        _, stderr = child.communicate(timeout=10)
        pytest.fail(f"main not ready: {line} {stderr[-3000:]}")
    prefix, main_pid, holder, *workers = line[0].split()[1:]
    return child, prefix, int(main_pid), int(holder), [int(w) for w in workers]


def _kill_group(child) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait(10)


def test_a_dead_jobs_names_are_swept_and_a_live_jobs_are_not():
    """Job A is SIGKILLed together with its workers, so nobody removes its names. Job B is
    alive. A new pool's sweep removes exactly A's names; B keeps running on its own, and
    when B's main is killed later its workers remove B's names.

    Runs in a child (dead_and_live_jobs) with a /dev/shm of its own where a namespace
    can be made: any POSIX pool made elsewhere on the machine (under pytest-xdist,
    another test of this run, at any moment) sweeps A's names too, and one that fell
    between the kill and the first check failed this test in CI. Where no namespace can
    be made, the child shares the machine's /dev/shm and that window stays open."""
    own = not (_namespace_refusal() or _own_shm_refusal())
    args = ("ns_init_own_shm", 0, "dead_and_live_jobs") if own else ("dead_and_live_jobs",)
    proc, r = run_child(*args, timeout=150, prefix=UNSHARE if own else ())
    print(r)
    assert proc.returncode == 0 and r, describe(proc)
    assert r["a_left"], "expected the killed job's control name to stay"
    assert r["b_before"]
    assert not r["a_after_pool"], r["a_after_pool"]
    assert r["b_after_pool"] == r["b_before"]
    assert not r["wrongly_removed"] and r["pool_names"]
    assert r["b_alive"], "the live job died"
    assert r["b_gone"], r["b_left"]
    assert r["b_workers_gone"]


def test_pools_of_one_process_do_not_sweep_each_other():
    """The owner lock is per open file description, so a second pool in the same process
    sees the first one's lock as held (a per-process lock would not)."""
    first = SlotPool(num_workers=1, slots=1, max_slots=2, slot_bytes=1 << 16)
    try:
        before = names_with(first.prefix)
        assert len(before) == 2  # the control block and slot 0, not yet mapped by a worker
        second = SlotPool(num_workers=1, slots=1, max_slots=2, slot_bytes=1 << 16)  # sweeps
        try:
            removed = sweep_stale()
            assert not [n for n in removed if ("/" + n).startswith((first.prefix, second.prefix))]
            assert names_with(first.prefix) == before and len(names_with(second.prefix)) == 2
        finally:
            second.close()
        assert names_with(first.prefix) == before
    finally:
        first.close()
    assert not names_with(first.prefix)


def test_a_dead_jobs_names_are_swept_although_its_pid_was_reused():
    """In a new PID namespace (with a /dev/shm of its own, so that no other pool on the
    machine sweeps the names first): main, its workers and a forked child of it are
    SIGKILLed at once, then main's pid is given to a new process. A sweep must still remove the
    names (a check by pid would find the pid alive). The sweep does not depend on how
    the workers were started: fork only."""
    needs_pid_namespace_with_own_shm()
    proc, result = run_child("ns_init_own_shm", 0, "pid_reuse", "fork", "all", timeout=150,
                             prefix=UNSHARE)
    print(result)
    assert proc.returncode == 0, describe(proc)
    assert result["recycled"], f"main's pid {result['main_pid']} went to {result['squatter']}"
    assert result["left_at_reuse"], "expected names left by the killed job"
    assert sorted(result["swept"]) == result["left_at_reuse"]
    assert result["gone"] and not result["names"]


# -- 2. parent death -----------------------------------------------------------------------------

@pytest.mark.parametrize("method", START_METHODS)
def test_workers_leave_and_unlink_when_main_is_killed(method):
    """SIGKILL of main, which has also forked a child that outlives it (that child keeps a
    forkserver's keep-alive pipe open, so the forkserver lives on): every worker notices
    within a few ticks, removes the names and exits."""
    child, prefix, main_pid, holder, workers = _start_main(method, hold=True)
    try:
        assert names_with(prefix)
        os.kill(main_pid, signal.SIGKILL)
        child.wait(10)
        t0 = time.monotonic()
        gone = wait_until(lambda: not names_with(prefix) and not any(running(w) for w in workers), 5.0)
        print(f"{method}: names and workers gone {time.monotonic() - t0:.2f} s after the kill")
        assert gone, f"names {names_with(prefix)}, workers alive {[w for w in workers if running(w)]}"
    finally:
        _kill_group(child)  # the holder, and anything left


@pytest.mark.parametrize("method", START_METHODS)
def test_workers_leave_when_main_is_killed_and_its_pid_reused(method):
    """As above, inside a new PID namespace, and main's pid is handed to a new process
    right after the kill: kill(main_pid, 0) now succeeds, yet the workers must still
    see that main is gone, remove the names and exit."""
    needs_pid_namespace_with_own_shm()
    proc, result = run_child("ns_init_own_shm", 0, "pid_reuse", method, "main", timeout=150,
                             prefix=UNSHARE)
    print(result)
    assert proc.returncode == 0, describe(proc)
    assert result["recycled"], f"main's pid {result['main_pid']} went to {result['squatter']}"
    assert result["gone"], f"names {result['names']}, workers alive {result['workers_alive']}"


def test_workers_keep_the_pool_when_the_forkserver_dies():
    """Under forkserver a worker's parent is the forkserver, not main. SIGKILL of the
    forkserver while main lives must not make the workers remove main's names or leave."""
    proc, result = run_child("forkserver_dies", timeout=120)
    print(result)
    assert proc.returncode == 0, describe(proc)
    assert result["names_after"], "the workers removed a live main's names"
    assert result["alive_after"] == result["workers"], "workers left while main lives"
    assert result["gone"], "names or workers left after main shut the pool down"


# -- 3. untrusted bytes --------------------------------------------------------------------------

CORRUPTIONS = ["capacity_zero", "capacity_huge", "tail_far_ahead", "head_past_tail"]


def _each_mode(body: str, modes: list[str], timeout: float):
    """Run `body` of _isolation_children.py for every mode in one child (one interpreter
    start instead of one a mode); (the process, {mode: its RESULT}). A mode the child
    did not finish has no RESULT: its test fails with the child's output."""
    with pytest.MonkeyPatch.context() as patch:  # module scope: before posix_backend
        patch.setenv("POOLLOADER_SHM_BACKEND", "posix")
        try:
            proc = subprocess.run([sys.executable, CHILDREN, "each", body, *modes],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"child {body} {modes} still running after {timeout} s:\n{e.stdout}\n{e.stderr}")
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    return proc, {result["mode"]: result for result in results}


@pytest.fixture(scope="module")
def corrupt_rings():
    return _each_mode("corrupt_ring", CORRUPTIONS, timeout=120)


@pytest.fixture(scope="module")
def corrupt_live_loaders():
    return _each_mode("corrupt_live_loader", [*CORRUPTIONS, "slot_outside_pool", "ticket_gone_back"],
                      timeout=300)


@pytest.mark.parametrize("mode", CORRUPTIONS)
def test_a_ring_with_overwritten_fields_raises_and_writes_nothing_outside(corrupt_rings, mode):
    """A ring holding four values gets one field overwritten. push and pop raise
    ControlCorrupt naming the ring (and keep raising), len is an error or a count within
    capacity, attaching refuses a bad capacity, and the page after the ring is untouched.
    In a child (all four modes in one): before the fix, capacity 0 was SIGFPE."""
    proc, results = corrupt_rings
    assert proc.returncode == 0 and mode in results, describe(proc)
    result = results[mode]
    out = result["outcomes"]
    print("\n".join(f"{op}: {what}" for op, what in out.items()))
    for op in ("push", "pop"):
        assert out[op].startswith("ControlCorrupt: test ring"), out[op]
        assert out[op].endswith("then ControlCorrupt again"), out[op]
    assert out["len"].startswith("ControlCorrupt") or int(out["len"].split()[-1]) <= 5, out["len"]
    if mode.startswith("capacity"):
        assert out["attach"].startswith("ValueError") and "recorded capacity" in out["attach"]
    else:
        assert out["attach"] == "returned 5"


@pytest.mark.parametrize("mode", CORRUPTIONS)
def test_a_live_loaders_overwritten_rings_are_a_clear_error_in_main(corrupt_live_loaders, mode):
    """A worker-like process maps a live loader's control block and overwrites one field
    of every ring while the workers are idle. main's next request or reply then meets a
    ring it cannot trust: ControlCorrupt naming the ring, at once, and nothing crashes
    (before the fix: SIGFPE for capacity 0, a silent pass for the counters). One child
    runs every mode's loader in turn (and the next test's), each with a pool of its own."""
    proc, results = corrupt_live_loaders
    assert proc.returncode == 0 and mode in results, describe(proc)
    result = results[mode]
    print(result)
    assert result["error"] == "ControlCorrupt", result
    assert "ring of worker" in result["message"] and "overwritten" in result["message"], result
    assert result["took"] < 5.0, result
    assert all(code is not None and code >= 0 for code in result["worker_exitcodes"].values()), result
    assert not result["names"], result


def test_a_slot_index_outside_the_pool_stops_its_worker_not_main(corrupt_live_loaders):
    """A worker-like process pushes slot -5 on worker 0's request ring. Before the fix
    the worker indexed the slot table with it (numpy wraps -5 to a real slot) and wrote a
    batch into a slot main owned; now the worker refuses it and dies, and main reports
    WorkerDied naming the worker. (The child's stderr is every mode's: only this one
    pushes a slot index, so the line can only be this worker's.)"""
    proc, results = corrupt_live_loaders
    assert proc.returncode == 0 and "slot_outside_pool" in results, describe(proc)
    result = results["slot_outside_pool"]
    print(result)
    assert result["error"] == "WorkerDied", result
    assert "worker 0" in result["message"] and "exit code 1" in result["message"], result
    assert "slot -5, outside the pool" in proc.stderr, proc.stderr[-3000:]
    assert not result["names"], result


def test_a_ticket_main_gave_out_before_stops_its_worker_not_main(corrupt_live_loaders):
    """A worker-like process pushes slot 0 under ticket 1 on worker 0's request ring (a
    value main wrote once, long before). Main's tickets only increase on a ring, so the
    worker refuses it (a stale value would otherwise be skipped as a moved request, and
    main would wait for it) and dies; main reports WorkerDied naming the worker."""
    proc, results = corrupt_live_loaders
    assert proc.returncode == 0 and "ticket_gone_back" in results, describe(proc)
    result = results["ticket_gone_back"]
    print(result)
    assert result["error"] == "WorkerDied", result
    assert "worker 0" in result["message"] and "exit code 1" in result["message"], result
    assert "gave ticket 1 (slot 0) after ticket" in proc.stderr, proc.stderr[-3000:]
    assert not result["names"], result


def test_acks_of_a_generation_main_never_made_are_refused():
    """The ack table tells main which names it may unlink; a worker claiming a generation
    that does not exist would make main unlink a name another worker still needs."""
    pool = SlotPool(num_workers=2, slots=2, max_slots=4, slot_bytes=1 << 16)
    try:
        assert pool.unlink_mapped() == 2  # no worker has mapped anything yet
        pool.control.acks[1, 0] = 7
        with pytest.raises(ControlCorrupt, match="worker 1 acknowledged generation 7 of slot 0"):
            pool.unlink_mapped()
        assert os.path.exists(SHM + slot_name(pool.prefix, 0, 1)), "unlinked on a forged ack"
        pool.control.acks[:, :] = [[1, 1, 0, 0], [1, 1, 0, 0]]  # what workers would write
        assert pool.unlink_mapped() == 0
    finally:
        pool.close()
    assert issubclass(ControlCorrupt, SlotCorrupt)


@pytest.mark.parametrize("field,value,match", [
    ("magic", 0, "not initialised"),
    ("workers", 1 << 40, "do not fit"),
    ("max_slots", 1 << 62, "do not fit"),
    ("max_slots", 0, "do not fit"),
])
def test_a_worker_refuses_a_control_header_that_does_not_fit(field, value, match):
    """What a worker reads once when it attaches (worker count, max_slots) must fit the
    segment, or every later index would be unchecked."""
    from poolloader.shm.control import H_MAGIC, H_MAX_SLOTS, H_WORKERS

    pool = SlotPool(num_workers=2, slots=1, max_slots=3, slot_bytes=1 << 16)
    try:
        header = pool.control.header
        index = {"magic": H_MAGIC, "workers": H_WORKERS, "max_slots": H_MAX_SLOTS}[field]
        saved = int(header[index])
        header[index] = value
        with pytest.raises(ControlCorrupt, match=match):
            Control.read_shape(pool._control_mapping)
        header[index] = saved
        assert Control.read_shape(pool._control_mapping) == (2, 3)
    finally:
        pool.close()


def test_the_growth_counter_main_publishes_is_its_own():
    """Main bumps the growth counter workers watch from its own copy, not from the
    shared field a worker could have overwritten."""
    from poolloader.shm.control import H_GROWTH

    pool = SlotPool(num_workers=1, slots=1, max_slots=3, slot_bytes=1 << 16)
    try:
        before = int(pool.control.header[H_GROWTH])
        pool.control.header[H_GROWTH] = np.uint64(2**64 - 1)
        pool.add_slot()
        assert int(pool.control.header[H_GROWTH]) == before + 1
    finally:
        pool.close()
