"""The shared-memory SPSC ring and doorbell (poolloader.shm._ring), across real processes.

Cross-process tests run under fork and spawn, with the ring in a POSIX segment
(a forked child inherits the mapping, a spawned child maps it by name). Every
wait and join has a timeout, so a broken ring fails a test instead of hanging.
Timing assertions check behaviour only (a timeout fires after about T, not
before, and not much later); speed lives in bench/ring.py.
"""
import collections
import multiprocessing
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _ring_children as children
import pytest
from helpers import communicate_within, layout, make_shared, running, unlink_shared, wait_in_futex
from hypothesis import given, settings
from hypothesis import strategies as st

from poolloader.errors import RingClosed, RingTimeout
from poolloader.shm._ring import DOORBELL_BYTES, TIMED_WAIT, Doorbell, Ring, claim, claim_and_push
from poolloader.shm._shm import Mapping

INT64 = st.integers(-(2**63), 2**63 - 1)


@pytest.fixture(params=["fork", "spawn"])
def ctx(request):
    return multiprocessing.get_context(request.param)


@pytest.fixture
def shared(ctx, shm_name_prefix):
    """Factory: a new segment of `nbytes` -> (mapping, what to hand the child).

    Under fork the child gets the mapping itself and the name is unlinked at once;
    under spawn it gets the name, which the test may `release` once the child has
    said it is attached, and which is unlinked at teardown in any case.
    """
    names = []

    def make(nbytes):
        name = f"{shm_name_prefix}{len(names)}"
        mapping, _ = make_shared(nbytes, name)
        names.append(name)
        if ctx.get_start_method() == "fork":
            unlink_shared(name)
            return mapping, mapping
        return mapping, name

    yield make
    for name in names:
        unlink_shared(name)


def release(handle):
    """Unlink a spawned child's segment name once it has mapped it."""
    if isinstance(handle, str):
        unlink_shared(handle)


def local_memory(nbytes):
    """Process-private shared memory (memfd): no name in /dev/shm to clean up."""
    fd = os.memfd_create("pltest-ring")
    try:
        os.ftruncate(fd, nbytes)
        return Mapping(fd, nbytes)
    finally:
        os.close(fd)


def local_ring(capacity, offset=0):
    return Ring(local_memory(offset + Ring.nbytes(capacity)), offset, capacity=capacity)


def in_thread(target):
    """Run `target` in a daemon thread; returns (thread, outcome list it appends to)."""
    outcome = []

    def body():
        started = time.monotonic()
        try:
            result = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result = exc
        outcome.append((result, time.monotonic() - started))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


# ---------------------------------------------------------------- streaming


def test_a_million_values_arrive_once_and_in_order(ctx, shared):
    count, capacity = 1_000_000, 7  # not a power of two: wraps ~143,000 times
    (ring_at,), nbytes = layout(Ring.nbytes(capacity))
    memory, handle = shared(nbytes)
    ring = Ring(memory, ring_at, capacity=capacity)
    producer = ctx.Process(target=children.produce,
                           args=(handle, nbytes, ring_at, 0, count, 30.0))
    with running(producer):
        assert ring.pop(30.0) == 0  # generous: a spawned child starts slowly on a busy box
        release(handle)
        pop = ring.pop
        for expected in range(1, count):
            value = pop(10.0)
            if value != expected:
                pytest.fail(f"value number {expected} arrived as {value}")
        producer.join(10.0)
    assert producer.exitcode == 0
    assert ring.try_pop() is None  # nothing twice
    assert len(ring) == 0


@pytest.mark.parametrize("capacity", [1, 3, 1000])
def test_odd_capacities_stream_to_a_child(ctx, shared, capacity):
    count = 20_000
    (ring_at,), nbytes = layout(Ring.nbytes(capacity))
    memory, handle = shared(nbytes)
    ring = Ring(memory, ring_at, capacity=capacity)
    consumer = ctx.Process(target=children.consume,
                           args=(handle, nbytes, ring_at, count, 30.0))
    with running(consumer):
        ring.push(0, 30.0)
        for value in range(1, count):
            ring.push(value, 10.0)
        consumer.join(10.0)
    assert consumer.exitcode == 0
    assert len(ring) == 0


# ---------------------------------------------------------------- edges, one process


@pytest.mark.parametrize("capacity", [1, 3, 1000])
def test_full_and_empty_edges_at_odd_capacities(capacity):
    ring = local_ring(capacity)
    assert ring.capacity == capacity
    first = 0
    for _ in range(4):  # each round starts one cell further on, so the wrap point moves
        assert ring.try_pop() is None
        with pytest.raises(RingTimeout):
            ring.pop(timeout=0)
        for i in range(capacity):
            assert ring.try_push(first + i) is True
        assert len(ring) == capacity
        assert ring.try_push(-1) is False
        with pytest.raises(RingTimeout):
            ring.push(-1, timeout=0)
        assert len(ring) == capacity
        assert [ring.try_pop() for _ in range(capacity)] == list(range(first, first + capacity))
        assert ring.try_pop() is None
        assert len(ring) == 0
        first += capacity
        ring.push(first, timeout=0)
        assert ring.pop(timeout=0) == first
        first += 1


def test_errors_subclass_the_builtins_callers_catch():
    assert issubclass(RingTimeout, TimeoutError)
    assert issubclass(RingClosed, RuntimeError)


def test_bad_arguments_are_refused():
    memory = local_memory(4096)
    with pytest.raises(ValueError):
        Ring(memory, 0, capacity=0)
    with pytest.raises(ValueError):
        Ring(memory, 0)  # nothing initialised there
    with pytest.raises(ValueError):
        Ring(memory, 8, capacity=1)  # not 64-byte aligned
    with pytest.raises(ValueError):
        Ring(memory, 0, capacity=4096)  # does not fit
    with pytest.raises(ValueError):
        Doorbell(memory, 0)  # no doorbell there
    ring = Ring(memory, 64, capacity=2)
    with pytest.raises(ValueError):
        ring.pop(timeout=-1)


@pytest.mark.parametrize("call", ["pop on empty", "push on full", "doorbell wait"])
def test_a_wait_gives_up_after_about_its_timeout(call):
    ring = local_ring(3)
    bell = Doorbell(local_memory(4096), 0, create=True)
    for value in range(3 if call == "push on full" else 0):
        ring.push(value)
    started = time.monotonic()
    if call == "doorbell wait":
        assert bell.wait(0.2) is False
    else:
        with pytest.raises(RingTimeout) as raised:
            ring.pop(timeout=0.2) if call == "pop on empty" else ring.push(9, timeout=0.2)
        assert "0.2" in str(raised.value)
    elapsed = time.monotonic() - started
    assert 0.19 <= elapsed < 2.0


@pytest.mark.parametrize("call", ["pop on empty", "doorbell wait"])
def test_a_wait_sleeps_instead_of_spinning(call):
    """A waiter that nobody wakes uses almost no CPU: a deadline on the wrong clock
    (one already past) would still time out on time, but by spinning."""
    ring = local_ring(3)
    bell = Doorbell(local_memory(4096), 0, create=True)

    def wait():
        cpu = time.thread_time()
        if call == "doorbell wait":
            assert bell.wait(1.5) is False
        else:
            with pytest.raises(RingTimeout):
                ring.pop(timeout=1.5)
        return time.thread_time() - cpu

    thread, outcome = in_thread(wait)
    thread.join(10.0)
    assert not thread.is_alive()
    (cpu_s, waited_s), = outcome
    assert 1.45 <= waited_s < 5.0
    assert cpu_s < 0.1, f"the waiter used {cpu_s:.2f} s of CPU in {waited_s:.2f} s: it spun"


# ---------------------------------------------------------------- close


@pytest.mark.parametrize("role", ["pop", "push"])
def test_close_wakes_a_peer_blocked_in_another_process(ctx, shared, role):
    (ring_at, control_at), nbytes = layout(Ring.nbytes(1), Ring.nbytes(4))
    memory, handle = shared(nbytes)
    ring = Ring(memory, ring_at, capacity=1)
    control = Ring(memory, control_at, capacity=4)
    if role == "push":
        ring.push(1)  # full: the child's push blocks
    child = ctx.Process(target=children.block_until_closed,
                        args=(handle, nbytes, ring_at, control_at, role))
    with running(child):
        assert control.pop(30.0) == children.READY
        release(handle)
        assert wait_in_futex(child.pid), f"the child never blocked in its {role}"
        closed_at = time.monotonic()
        ring.close()
        blocked_ms = control.pop(10.0)
        child.join(10.0)
        woke_after = time.monotonic() - closed_at
    assert child.exitcode == 0, "the blocked call did not raise RingClosed"
    assert 20 <= blocked_ms < 20_000, f"blocked {blocked_ms} ms: not seen waiting, or its timeout"
    assert woke_after < 20.0  # the child's own timeout is 30 s
    assert ring.closed


@pytest.mark.parametrize("role", ["pop", "push"])
def test_close_wakes_a_thread_blocked_in_this_process(role):
    memory = local_memory(Ring.nbytes(1))
    ring = Ring(memory, 0, capacity=1)
    if role == "push":
        ring.push(1)
    thread, outcome = in_thread(
        (lambda: ring.pop(30.0)) if role == "pop" else (lambda: ring.push(2, 30.0)))
    in_ring = (memory.address, memory.address + memory.size)
    assert wait_in_futex(os.getpid(), thread.native_id, within=in_ring), \
        f"the thread never blocked in its {role}"
    ring.close()
    thread.join(5.0)
    assert not thread.is_alive()
    (result, blocked_s), = outcome
    assert isinstance(result, RingClosed), result
    assert blocked_s < 20.0  # woken by close(), not by its 30 s timeout
    # closed for good, from both ends and for every kind of call
    for call in (ring.try_pop, lambda: ring.try_push(3), lambda: ring.pop(0), lambda: ring.push(3, 0)):
        with pytest.raises(RingClosed):
            call()


# ---------------------------------------------------------------- dead peers


def test_a_producer_killed_mid_stream_leaves_the_consumer_able_to_time_out(ctx, shared):
    capacity = 7
    (ring_at,), nbytes = layout(Ring.nbytes(capacity))
    memory, handle = shared(nbytes)
    ring = Ring(memory, ring_at, capacity=capacity)
    producer = ctx.Process(target=children.produce_until_killed, args=(handle, nbytes, ring_at))
    with running(producer):
        assert ring.pop(30.0) == 0
        release(handle)
        for expected in range(1, 10_000):
            assert ring.pop(10.0) == expected
        os.kill(producer.pid, signal.SIGKILL)
        producer.join(5.0)
    assert producer.exitcode == -signal.SIGKILL
    expected = 10_000
    while True:  # what it pushed before dying is still there, in order; then a timeout
        started = time.monotonic()
        try:
            value = ring.pop(timeout=0.2)
        except RingTimeout:
            break
        assert value == expected
        expected += 1
        assert expected - 10_000 <= capacity, "more values than cells after the producer died"
    assert 0.19 <= time.monotonic() - started < 2.0


def test_a_consumer_killed_mid_stream_leaves_the_producer_able_to_time_out(ctx, shared):
    capacity = 7
    (ring_at,), nbytes = layout(Ring.nbytes(capacity))
    memory, handle = shared(nbytes)
    ring = Ring(memory, ring_at, capacity=capacity)
    consumer = ctx.Process(target=children.consume_until_killed, args=(handle, nbytes, ring_at))
    with running(consumer):
        ring.push(0, 30.0)
        for value in range(1, 10_000):
            ring.push(value, 10.0)
        os.kill(consumer.pid, signal.SIGKILL)
        consumer.join(5.0)
    assert consumer.exitcode == -signal.SIGKILL
    pushed = 0
    while True:  # fills the cells the dead consumer left, then times out
        started = time.monotonic()
        try:
            ring.push(-5, timeout=0.2)
        except RingTimeout:
            break
        pushed += 1
        assert pushed <= capacity, "more pushes than cells after the consumer died"
    assert 0.19 <= time.monotonic() - started < 2.0


# ---------------------------------------------------------------- the GIL


@pytest.mark.parametrize("call", ["pop on empty", "push on full", "doorbell wait"])
def test_the_gil_is_released_while_waiting(call):
    """A thread blocked in the ring must not stop other Python threads.

    The switch interval is raised to 30 s, so a waiter that held the GIL would
    starve this thread until its own 5 s timeout: it would time out instead of
    receiving what this thread hands it after 0.3 s of pure-Python work.
    """
    ring_memory, bell_memory = local_memory(Ring.nbytes(2)), local_memory(4096)
    ring = Ring(ring_memory, 0, capacity=2)
    bell = Doorbell(bell_memory, 0, create=True)
    memory = bell_memory if call == "doorbell wait" else ring_memory
    if call == "push on full":
        ring.push(10)
        ring.push(11)
    waits = {"pop on empty": lambda: ring.pop(5.0),
             "push on full": lambda: ring.push(12, 5.0),
             "doorbell wait": lambda: bell.wait(5.0)}
    unblock = {"pop on empty": lambda: ring.push(42),
               "push on full": lambda: ring.pop(),
               "doorbell wait": bell.ring}
    expected = {"pop on empty": 42, "push on full": None, "doorbell wait": True}

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        thread, outcome = in_thread(waits[call])
        assert wait_in_futex(os.getpid(), thread.native_id,
                             within=(memory.address, memory.address + memory.size)), \
            "the thread never got into its wait"
        spins, until = 0, time.monotonic() + 0.3
        while time.monotonic() < until:
            spins += 1
        unblock[call]()
        thread.join(10.0)
    finally:
        sys.setswitchinterval(old_interval)
    assert not thread.is_alive()
    (result, waited_s), = outcome
    assert result == expected[call], f"the waiter got {result!r} (it starved this thread)"
    assert 0.25 <= waited_s < 3.0
    assert spins > 0


class Interrupted(Exception):
    pass


def test_a_signal_handler_interrupts_a_blocked_pop():
    """Ctrl-C must reach a main process blocked in the ring (its handler runs and raises)."""
    def raise_interrupted(signum, frame):
        raise Interrupted

    ring = local_ring(1)
    old_handler = signal.signal(signal.SIGUSR1, raise_interrupted)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        started = time.monotonic()
        timer.start()
        with pytest.raises(Interrupted):
            ring.pop(timeout=10.0)
        assert 0.15 <= time.monotonic() - started < 2.0
    finally:
        timer.cancel()
        timer.join(5.0)
        signal.signal(signal.SIGUSR1, old_handler)


# ---------------------------------------------------------------- doorbell


def test_the_doorbell_wakes_a_waiter_in_another_process(ctx, shared):
    (bell_at, control_at), nbytes = layout(DOORBELL_BYTES, Ring.nbytes(4))
    memory, handle = shared(nbytes)
    bell = Doorbell(memory, bell_at, create=True)
    control = Ring(memory, control_at, capacity=4)
    waiter = ctx.Process(target=children.wait_for_bell, args=(handle, nbytes, bell_at, control_at))
    with running(waiter):
        assert control.pop(30.0) == children.READY
        release(handle)
        assert wait_in_futex(waiter.pid), "the waiter never blocked on the doorbell"
        bell.ring()
        waited_ms = control.pop(10.0)
        waiter.join(10.0)
    assert waiter.exitcode == 0, "the waiter was not woken within 10 s"
    assert 20 <= waited_ms < 10_000  # seen waiting twice 20 ms apart; woken before its 10 s


def test_one_doorbell_collects_many_producers(ctx, shared):
    count, capacity = 500, 8
    ring_bytes = Ring.nbytes(capacity)
    (bell_at, *rings_at), nbytes = layout(DOORBELL_BYTES, ring_bytes, ring_bytes)
    memory, handle = shared(nbytes)
    bell = Doorbell(memory, bell_at, create=True)
    rings = [Ring(memory, at, capacity=capacity) for at in rings_at]
    producers = [ctx.Process(target=children.produce_and_ring,
                             args=(handle, nbytes, at, bell_at, tag, count))
                 for tag, at in enumerate(rings_at, start=1)]
    got = {tag: [] for tag in (1, 2)}
    with running(producers[0]), running(producers[1]):
        while any(len(values) < count for values in got.values()):
            assert bell.wait(30.0), f"no ring within 30 s; got {[len(v) for v in got.values()]}"
            for tag, ring in enumerate(rings, start=1):
                while (value := ring.try_pop()) is not None:
                    got[tag].append(value)
        for producer in producers:
            producer.join(10.0)
    assert [p.exitcode for p in producers] == [0, 0]
    for tag, values in got.items():
        assert values == [tag * 1_000_000 + i for i in range(count)]


# ---------------------------------------------------------------- model check

OPS = st.one_of(
    st.tuples(st.just("try_push"), INT64),
    st.tuples(st.just("push"), INT64),  # push(v, timeout=0)
    st.tuples(st.just("try_pop")),
    st.tuples(st.just("pop")),  # pop(timeout=0)
    st.tuples(st.just("len")),
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 9), offset=st.sampled_from([0, 64, 4096]),
       ops=st.lists(OPS, max_size=60), close_at_end=st.booleans())
def test_any_sequence_of_operations_behaves_like_a_bounded_deque(
        capacity, offset, ops, close_at_end):
    memory = local_memory(offset + Ring.nbytes(capacity))
    producer = Ring(memory, offset, capacity=capacity)
    consumer = Ring(memory, offset)  # a second handle, attached as the other process would
    assert consumer.capacity == capacity
    model = collections.deque()
    for op, *args in ops:
        full, empty = len(model) == capacity, not model
        if op == "try_push":
            assert producer.try_push(args[0]) is (not full)
            if not full:
                model.append(args[0])
        elif op == "push":
            if full:
                with pytest.raises(RingTimeout):
                    producer.push(args[0], timeout=0)
            else:
                producer.push(args[0], timeout=0)
                model.append(args[0])
        elif op == "try_pop":
            assert consumer.try_pop() == (None if empty else model.popleft())
        elif op == "pop":
            if empty:
                with pytest.raises(RingTimeout):
                    consumer.pop(timeout=0)
            else:
                assert consumer.pop(timeout=0) == model.popleft()
        assert len(producer) == len(consumer) == len(model)
    if close_at_end:
        consumer.close()
        assert producer.closed and consumer.closed
        with pytest.raises(RingClosed):
            producer.try_push(0)
        with pytest.raises(RingClosed):
            consumer.try_pop()  # queued values are not delivered after close


# ---------------------------------------------------------------- the sem_timedwait fallback


def test_the_build_says_which_timed_wait_it_compiled():
    """glibc >= 2.30 builds on sem_clockwait, anything older on sem_timedwait, unless
    the fallback run below forced sem_timedwait (and says so in the environment)."""
    expected = os.environ.get("POOLLOADER_TEST_TIMED_WAIT")
    if expected is None:
        libc, version = platform.libc_ver()
        modern = libc == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 30)
        expected = "sem_clockwait" if modern else "sem_timedwait"
    assert TIMED_WAIT == expected


# What the fallback run covers: timeouts bounded both ways (pop, push, doorbell, a dead
# peer), wake-ups by push, pop, close, the doorbell and a signal, streams through odd
# capacities. Fork only: spawn adds process start-up, not another path through the wait.
FALLBACK_CASES = "not spawn and not million and not fallback"


@pytest.mark.timeout(660)
def test_the_sem_timedwait_fallback_passes_the_ring_tests(tmp_path):
    """Builds a copy of the tree with POOLLOADER_FORCE_SEM_TIMEDWAIT=1 (the path of
    glibc < 2.30) and runs this file's FALLBACK_CASES against that build."""
    root = Path(__file__).resolve().parents[1]
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("*.so", "*.c", "__pycache__", ".hypothesis", "build")
    for part in ("csrc", "poolloader", "tests"):
        shutil.copytree(root / part, tree / part, ignore=ignore)
    for part in ("setup.py", "pyproject.toml"):
        shutil.copy2(root / part, tree / part)
    env = dict(os.environ, POOLLOADER_FORCE_SEM_TIMEDWAIT="1")
    build = subprocess.Popen([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_within(build, 300, "the build with POOLLOADER_FORCE_SEM_TIMEDWAIT=1")
    assert build.returncode == 0, f"the build failed:\n{out[-2000:]}\n{err[-3000:]}"
    assert "timed waits use sem_timedwait" in out + err, "the compiler did not log the path it built"

    env["POOLLOADER_TEST_TIMED_WAIT"] = "sem_timedwait"  # checked by the test above, in that run
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_ring.py", "-k", FALLBACK_CASES], cwd=tree, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_within(run, 300, "the ring tests against the sem_timedwait build")
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert run.returncode == 0, f"{out[-6000:]}\n{err[-2000:]}"
    assert re.search(r"\d+ passed", summary) and "deselected" in summary, summary


# ---------------------------------------------------------------- claims

def test_claims_raced_by_two_processes_go_to_exactly_one_of_them(ctx, shared):
    """A request's claim word (the worker that pops it and main moving it race for it):
    a child and this process swap the same 20000 words from their tickets to 0, the
    child from the end, this process from the start once the child is attached, so
    they race where they meet. Every word is won exactly once, and holds 0 after."""
    words = 20000
    nbytes = words * 8 + words + 1
    mapping, handle = shared(nbytes)
    u64 = memoryview(mapping).cast("B")[:words * 8].cast("Q")
    for i in range(words):
        u64[i] = i + 1
    child = ctx.Process(target=children.claim_all, args=(handle, nbytes, words, words * 8, True))
    child.start()
    try:
        marks = memoryview(mapping)[words * 8:]
        deadline = time.monotonic() + 60
        while not marks[words] and time.monotonic() < deadline and child.is_alive():
            time.sleep(0.001)
        marks.release()
        mine = [i for i in range(words) if claim(mapping, i * 8, i + 1)]
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
    marks = memoryview(mapping)[words * 8:]
    theirs = [i for i in range(words) if marks[i]]
    marks.release()
    print(f"this process won {len(mine)}, the child {len(theirs)}")
    assert sorted(mine + theirs) == list(range(words))
    assert not any(u64[i] for i in range(words))
    u64.release()


def test_a_claim_wins_only_its_ticket_and_pushes_only_when_it_wins():
    mapping = local_memory(4096 + Ring.nbytes(1))
    ring = Ring(mapping, 4096, capacity=1)
    word = memoryview(mapping).cast("B")[:8].cast("Q")
    word[0] = 7
    assert not claim(mapping, 0, 6) and word[0] == 7  # another ticket: not this request
    assert claim_and_push(mapping, 0, 6, ring, 40) == 0 and len(ring) == 0
    assert claim_and_push(mapping, 0, 7, ring, 41) == 1 and word[0] == 0 and ring.try_pop() == 41
    assert not claim(mapping, 0, 7)  # taken once, by one side only
    word[0] = 9
    assert ring.try_push(1)  # full: the claim is still taken, and the caller told
    assert claim_and_push(mapping, 0, 9, ring, 42) == 2 and word[0] == 0
    with pytest.raises(ValueError, match="no aligned u64"):
        claim(mapping, 3, 1)
    with pytest.raises(ValueError, match="no aligned u64"):
        claim(mapping, len(mapping) - 4, 1)
    word.release()
