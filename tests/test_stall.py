"""Stall reports: a stuck worker is shown (pid, samples, since when, the blocking line),
on timeout as the error and without timeout as a warning, with real worker processes."""
import functools
import gc
import multiprocessing
import os
import re
import signal
import threading
import time
import warnings
import weakref

import diagnose_datasets as dd
import pytest
from helpers import wait_until

from poolloader import PoolLoader, StallWarning
from poolloader.main import stall
from poolloader.main.stall import format_dump
from poolloader.worker.stall import STACK_SIGNAL, busy_stamp, read_stamp


def line_of(marker):
    with open(dd.__file__) as f:
        for number, line in enumerate(f, 1):
            if marker in line:
                return number
    raise AssertionError(f"{marker!r} not in {dd.__file__}")


def blocking_frame(marker="the blocking line a stall report must show", func="__getitem__"):
    return f'File "{dd.__file__}", line {line_of(marker)} in {func}'


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_timeout_error_names_the_worker_its_samples_and_the_blocking_line(method):
    ctx = multiprocessing.get_context(method)
    gate = ctx.Event()
    # timeout= bounds the first next() too, which waits for the workers to start: a
    # spawned worker imports torch, which alone took over 5 s on this 2-core machine
    # while other jobs ran. So the first next() comes once both workers have begun
    # their first sample (0: worker 0's, 3: worker 1's), as the fork case's do at once.
    reached = {0: ctx.Event(), 3: ctx.Event()}
    timeout = 5
    loader = PoolLoader(dd.BlockOnSample({13: gate}, n=30, reached=reached), batch_size=3,
                        num_workers=2, timeout=timeout, multiprocessing_context=ctx)
    started = time.monotonic()
    it = iter(loader)
    assert all(event.wait(60) for event in reached.values()), "the workers did not start in 60 s"
    got = []
    try:
        with pytest.raises(RuntimeError) as info:
            while True:
                began = time.monotonic()  # the next() that blocks starts here
                got.append(next(it))
        elapsed = time.monotonic() - began
        pid = it.worker_pids[0]  # batch 4 (samples 12-14) goes to worker 0, round-robin
    finally:
        gate.set()
    message = str(info.value)
    lines = message.splitlines()
    assert lines[0] == f"DataLoader timed out after {timeout} seconds"  # DataLoader's, unchanged
    assert timeout <= elapsed < timeout + 10.0  # the timeout, plus at most the bounded report
    assert [int(b[0]) for b in got] == [0, 3, 6, 9]
    stuck = re.search(rf"worker 0 \(pid {pid}\): on batch 4 for ([\d.]+) s, "
                      r"samples \[12, 13, 14\]", message)
    assert stuck, message
    # on it since before this next() (a prefetched request), and at most since iter()
    assert timeout - 0.5 <= float(stuck.group(1)) <= time.monotonic() - started
    assert blocking_frame() in message, message
    assert "worker 1 " not in message  # worker 1 delivered all it owed: not named
    # the iterator survives its timeout, as DataLoader's does: the rest of the epoch comes
    rest = [int(b[0]) for b in it]
    assert rest == list(range(12, 30, 3))


def _timeout_report(loader, gate, consume):
    """`consume(iter(loader))` must time out (timeout=3) while worker 0 blocks on `gate`;
    returns (the RuntimeError's message, worker 0's pid). The gate is opened after."""
    it = iter(loader)
    try:
        with pytest.raises(RuntimeError) as info:
            consume(it)
        pid = it.worker_pids[0]
    finally:
        gate.set()
    message = str(info.value)
    assert message.splitlines()[0] == "DataLoader timed out after 3 seconds"
    return message, pid


def test_stall_in_worker_init_fn_is_shown_before_any_batch():
    ctx = multiprocessing.get_context("fork")
    gate = ctx.Event()
    loader = PoolLoader(dd.BlockOnSample({}, n=12), batch_size=3, num_workers=2, timeout=3,
                        worker_init_fn=dd.BlockingInit(gate), multiprocessing_context=ctx)
    message, pid = _timeout_report(loader, gate, next)
    assert f"worker 0 (pid {pid}): not on any batch yet" in message, message
    assert "samples [0, 1, 2]" in message
    assert blocking_frame("the blocking line of the init", "__call__") in message, message


def test_iterable_dataset_stall_names_the_worker_and_the_line():
    ctx = multiprocessing.get_context("fork")
    gate = ctx.Event()
    loader = PoolLoader(dd.BlockingStream(gate), batch_size=2, num_workers=2, timeout=3,
                        multiprocessing_context=ctx)
    message, pid = _timeout_report(loader, gate, list)
    assert f"worker 0 (pid {pid}): on batch " in message, message
    assert "(an IterableDataset batch: no sample indices)" in message
    assert blocking_frame("the blocking line of the stream", "__iter__") in message, message


def test_without_timeout_a_stall_warns_once_per_stall_and_the_epoch_completes():
    ctx = multiprocessing.get_context("fork")
    gates = {13: ctx.Event(), 25: ctx.Event()}
    threshold = 0.5
    loader = PoolLoader(dd.BlockOnSample(gates, n=30), batch_size=3, num_workers=2,
                        stall_warning=threshold, multiprocessing_context=ctx)
    caught = []
    seen_at = []

    def release_on_warning():
        # Release each stuck sample once its warning came, and only after 4 thresholds
        # more: a second warning for the same stall would be in `caught` by then.
        deadline = time.monotonic() + 60
        for k, sample in enumerate((13, 25), 1):
            while len(caught) < k and time.monotonic() < deadline:
                time.sleep(0.02)
            seen_at.append(time.monotonic())
            time.sleep(4 * threshold)
            gates[sample].set()
        for gate in gates.values():
            gate.set()  # whatever happened, nothing stays blocked

    helper = threading.Thread(target=release_on_warning, daemon=True)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        caught = records
        helper.start()
        try:
            t0 = time.monotonic()
            batches = [int(b[0]) for b in loader]
        finally:
            for gate in gates.values():
                gate.set()
            helper.join(timeout=70)
    elapsed = time.monotonic() - t0
    assert batches == list(range(0, 30, 3))  # the epoch completes once each sample unblocks
    stalls = [w for w in records if issubclass(w.category, StallWarning)]
    assert len(stalls) == 2, [str(w.message) for w in records]  # once per stall, both stalls
    first, second = (str(w.message) for w in stalls)
    assert "samples [12, 13, 14]" in first and "samples [24, 25, 26]" in second
    for message in (first, second):
        assert blocking_frame() in message, message
        waited = float(re.search(r"has waited ([\d.]+) s", message).group(1))
        assert threshold <= waited < threshold + 5.0
        assert re.search(r"worker \d \(pid \d+\): on batch \d for [\d.]+ s", message)
    assert stalls[0].filename == __file__  # points at the loop that waits
    assert elapsed < 60


def test_busy_stamp_round_trip():
    now = 123_456_789_012_345
    for slot in (0, 1, 7, 65533):
        stamp = busy_stamp(slot, now - 2_500_000_000)
        got_slot, on_it = read_stamp(stamp, now)
        assert got_slot == slot and on_it == pytest.approx(2.5)
    for forged in (70_000, -5, -1):  # past the slot field, or a corrupt ring's index
        assert read_stamp(busy_stamp(forged, now), now + 1000) == (None, pytest.approx(1e-6))
    assert read_stamp(0, now) == (None, None)
    # the time field wraps (every 2**48 µs) without a negative or huge duration
    wrap = (1 << 48) * 1000
    assert read_stamp(busy_stamp(3, wrap - 1000), wrap + 1000)[1] == pytest.approx(2e-6)


def test_format_dump_cuts_at_the_worker_loop_and_keeps_innermost_frames():
    frames = [f'  File "/d/m.py", line {i} in f{i}' for i in range(20)]
    dump = "\n".join(
        ["Current thread 0x1 (most recent call first):", *frames[:3],
         '  File "/x/poolloader/worker/loop.py", line 160 in worker_loop',
         '  File "/usr/lib/multiprocessing/process.py", line 108 in run', "",
         "Thread 0x2 (most recent call first):", *frames])
    text = format_dump(dump)
    assert "process.py" not in text  # multiprocessing's own frames are left out
    assert 'File "/d/m.py", line 0 in f0' in text and "line 11 in f11" in text
    assert "line 12 in f12" not in text and "... 8 outer frames" in text
    assert text.splitlines()[0].startswith("Current thread 0x1")


def test_a_dropped_iterator_is_freed_at_once():
    # the stall reporter Replies keeps must not hold the iterator (a cycle would
    # leave its workers running until the next garbage collection)
    loader = PoolLoader(dd.SleepDataset(12, 0.0), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    ref = weakref.ref(it)
    gc.disable()
    try:
        del it
        assert ref() is None
    finally:
        gc.enable()


# -- the stack signal: whom it reaches, and whose handler it calls -----------------------

def _record_signal(path, signum, frame):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def _recorded(path) -> set[int]:
    try:
        with open(path) as f:
            return {int(line) for line in f if line.strip()}
    except FileNotFoundError:
        return set()


def _take_stack_signal(path, worker_id):
    """worker_init_fn: worker 0 installs its own handler for the stack signal."""
    if worker_id == 0:
        signal.signal(STACK_SIGNAL, functools.partial(_record_signal, path))


def _ignore_stack_signal_in_c(path, worker_id):
    """worker_init_fn: worker 0 sets SIG_IGN for the stack signal through libc (not
    through Python's signal module, which poolloader watches)."""
    import ctypes
    if worker_id == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(STACK_SIGNAL, 1)  # SIG_IGN


def _stack_file_text(pid) -> bytes:
    path = stall._dump_file(pid)
    assert path is not None, f"worker {pid} has no stack file"
    with open(path, "rb") as f:
        return f.read()


def _two_stalled_workers(ctx, **kw):
    """Batch 0 (worker 0) blocks on sample 1, batch 1 (worker 1) on sample 4."""
    gates = {1: ctx.Event(), 4: ctx.Event()}
    loader = PoolLoader(dd.BlockOnSample(gates, n=12), batch_size=3, num_workers=2,
                        timeout=3, multiprocessing_context=ctx, **kw)
    return loader, gates


def test_only_the_worker_whose_batch_is_waited_for_is_signalled():
    ctx = multiprocessing.get_context("fork")
    loader, gates = _two_stalled_workers(ctx)
    it = iter(loader)
    try:
        with pytest.raises(RuntimeError) as info:
            next(it)
        w0, w1 = it.worker_pids
        other = _stack_file_text(w1)
    finally:
        for gate in gates.values():
            gate.set()
    message = str(info.value)
    assert f"worker 0 (pid {w0}): on batch 0" in message, message
    assert blocking_frame() in message, message
    assert f"worker 1 (pid {w1}): on batch 1" in message, message
    assert "no stack: not signalled (only worker 0, whose batch 0 is waited for, is)" in message
    assert b"most recent call first" not in other, other  # worker 1 never dumped
    assert [int(b[0]) for b in it] == [0, 3, 6, 9]


@pytest.mark.parametrize("how,what", [(_take_stack_signal, "the Python handler "),
                                      (_ignore_stack_signal_in_c, "SIG_IGN")])
def test_a_worker_with_its_own_handler_for_the_signal_is_not_signalled(tmp_path, how, what):
    ctx = multiprocessing.get_context("fork")
    record = str(tmp_path / "calls")
    gate = ctx.Event()
    loader = PoolLoader(dd.BlockOnSample({1: gate}, n=12), batch_size=3, num_workers=2,
                        timeout=3, multiprocessing_context=ctx,
                        worker_init_fn=functools.partial(how, record))
    message, pid = _timeout_report(loader, gate, next)
    assert f"worker 0 (pid {pid}): on batch 0" in message, message
    assert (f"no stack: the worker installed its own handler for signal {STACK_SIGNAL} "
            f"(SIGRTMIN+7, the stack signal): {what}") in message, message
    assert "it was not signalled" in message
    assert pid not in _recorded(record), "the worker's own handler was called"


def test_a_handler_inherited_from_main_is_chained(tmp_path):
    ctx = multiprocessing.get_context("fork")
    record = str(tmp_path / "calls")
    gate = ctx.Event()
    loader = PoolLoader(dd.BlockOnSample({1: gate}, n=12), batch_size=3, num_workers=2,
                        timeout=3, multiprocessing_context=ctx)
    previous = signal.signal(STACK_SIGNAL, functools.partial(_record_signal, record))
    try:
        it = iter(loader)  # the fork workers inherit main's handler
    finally:
        signal.signal(STACK_SIGNAL, previous)
    try:
        with pytest.raises(RuntimeError) as info:
            next(it)
        pid = it.worker_pids[0]
        # the inherited handler runs in the worker after the dump (its wait is interrupted)
        called = wait_until(lambda: pid in _recorded(record), 10)
    finally:
        gate.set()
    message = str(info.value)
    assert blocking_frame() in message, message  # poolloader's own work first
    assert called, "the handler the worker inherited from main was not called"
    assert _recorded(record) == {pid}  # only the signalled worker
    assert [int(b[0]) for b in it] == [0, 3, 6, 9]
